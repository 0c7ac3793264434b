"""Whether bfloat16 layers pay on this CPU for a network, decided by timing a few of its own
convolutions in both types (a CPU flag cannot tell: without AMX, bfloat16 is ~2x faster than
float32 on AMD Zen 4 and 1.4-1.8x slower on an Intel Xeon with the same AVX512_BF16 flag).

The verdict is kept in a small JSON file per CPU model, ISA limit, threads and layer shapes, so a
later run of the same network skips the probe; a file lock makes the ranks of one node probe once
and agree."""
import fcntl
import json
import os
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

from src.cpu_layers.library import isa_cap, probe_convolution_ms
from src.files import write_atomic

# (batch, in channels, input size, out channels, kernel, stride) of one convolution to time.
ProbeLayer = Tuple[int, int, int, int, int, int]
# bfloat16 must beat float32 by this much: the layers' other costs (weight reorders, the block inputs'
# copies) are not in the probe, and a near tie should not flip between runs.
MARGIN = 0.9


class Verdict(NamedTuple):
    """The probe's result: whether bfloat16 pays, the summed timings (ms), and whether they were read
    from an earlier run's cache."""
    pays: bool
    float32_ms: float
    bfloat16_ms: float
    cached: bool


def default_cache_file() -> str:
    """Where verdicts are kept between runs: ~/.cache/resnet-mindspore/bf16_verdicts.json."""
    return os.path.join(os.path.expanduser("~"), ".cache", "resnet-mindspore", "bf16_verdicts.json")


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            found = json.load(handle)
        return found if isinstance(found, dict) else {}
    except (OSError, ValueError):
        return {}


def bf16_verdict(layers: Sequence[ProbeLayer], *, cpu_model: str, threads: int, cache_file: Optional[str] = None,
                 time_layer: Callable[..., float] = probe_convolution_ms) -> Verdict:
    """Time `layers` (forward and both backwards each) in float32 and in bfloat16, or read the timings
    an earlier run on this CPU kept. `time_layer(*layer, bf16=...)` returns milliseconds; the CPU must
    have bfloat16 convolutions (library.channels_per_block)."""
    path = cache_file or default_cache_file()
    key = json.dumps({"cpu": cpu_model, "isa": isa_cap(), "threads": threads, "layers": [list(x) for x in layers]},
                     sort_keys=True)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".lock", "w", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the ranks of one node: the first probes, the others read
        known = _read(path)
        cached = key in known
        if not cached:
            known[key] = [round(sum(time_layer(*layer, bf16=bf16) for layer in layers), 2) for bf16 in (False, True)]
            write_atomic(path, json.dumps(known, indent=1) + "\n")
    float32_ms, bfloat16_ms = known[key]
    return Verdict(bfloat16_ms < MARGIN * float32_ms, float32_ms, bfloat16_ms, cached)
