"""One training step taken apart: oneDNN's primitives by kind (oneDNN's verbose execution profile)
and the rest of the step, then that rest op by op (MindSpore's profiler), in the measuring process
of its path once its speeds are measured (or alone: benchmark.py --worker NAME --breakdown onednn|operators)."""
import contextlib
import ctypes
import json
import os
import re
import tempfile
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

BREAKDOWN_MARK = "BREAKDOWN "
BREAKDOWN_KINDS = {"convolution": "convolutions", "batch_normalization": "normalization", "pooling": "pooling",
                   "reorder": "layout reorders", "matmul": "matrix products"}
# A convolution's propagation kind in oneDNN's profile, and the pass of the training step it is.
CONVOLUTION_PASSES = {"forward_training": "forward", "forward_inference": "forward",
                      "backward_data": "backward data", "backward_weights": "backward weights"}


# Operators whose time is oneDNN's (counted by kind above): our layers, and MindSpore's own convolution,
# normalization and pooling kernels.
ONEDNN_OPERATORS = ("Custom:OneDnn", "Custom:BlockedToPlain", "Conv2D", "BatchNorm", "MaxPool")
# Operators named one by one in the rest; the others are summed.
NAMED_OPERATORS = 8
# Steps a fresh process trains before a breakdown: the first compiles, the next settle.
WARM_UP_STEPS = 3
# Steps the oneDNN breakdown runs profiled, and as many unprofiled, in turn.
BREAKDOWN_STEPS = 4
# The line that ends a profiled stretch in the captured output.
STRETCH_END = "breakdown: end of a profiled stretch"


def serve_breakdown(runner, kind: str) -> int:
    """A process of one breakdown alone: prints BREAKDOWN_MARK and the JSON of 'onednn'
    (onednn_breakdown) or 'operators' (operator_table)."""
    for _ in range(WARM_UP_STEPS):
        runner.train_step()
    if kind == "onednn":
        kinds, passes = onednn_breakdown(runner)
        result = {"kinds": kinds, "convolution_passes": passes}
    else:
        result = {"operators": operator_table(runner)}
    print(BREAKDOWN_MARK + json.dumps(result), flush=True)
    return 0


def step_taken_apart(runner) -> Dict[str, Dict[str, float]]:
    """The breakdowns of a warm runner's training step: 'kinds' and 'passes' (onednn_breakdown), 'own'
    (our layers' own loops in those steps, part of their rest: own_loops_ms) and 'rest' (the rest op
    by op, rest_by_operator)."""
    runner.train_step()
    before = _own_loop_seconds()
    kinds, passes = onednn_breakdown(runner, BREAKDOWN_STEPS)
    own = own_loops_ms(before, _own_loop_seconds(), 2 * BREAKDOWN_STEPS)
    return {"kinds": kinds, "passes": passes, "own": own, "rest": rest_by_operator(operator_table(runner))}


def _own_loop_seconds() -> Dict[str, float]:
    """Our layers' own loop timers (src.cpu_layers.library.own_loop_seconds), or none where this
    process has not loaded our library (MindSpore's convolutions)."""
    from src.cpu_layers import library
    return library.own_loop_seconds() if _already_loaded(library.LIBRARY) else {}


def own_loops_ms(before: Dict[str, float], after: Dict[str, float], steps: int) -> Dict[str, float]:
    """Milliseconds per step each of our layers' own loops took between two readings of their timers:
    time inside our kernels outside oneDNN's primitives, which the breakdown counts in the rest."""
    return {name: round((after[name] - before[name]) * 1000 / steps, 1) for name in after}


def operator_table(runner, steps: int = 4) -> Dict[str, float]:
    """`steps` training steps under MindSpore's profiler: each operator type's milliseconds per step
    (src.evaluation.profile_table, our layers by cell)."""
    from mindspore.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    from src.evaluation.profile_table import find_summary, read_summary
    with tempfile.TemporaryDirectory(prefix="benchmark-profile-") as folder:
        profiler = profile(activities=[ProfilerActivity.CPU], on_trace_ready=tensorboard_trace_handler(folder),
                           schedule=schedule(wait=0, warmup=1, active=steps, repeat=1, skip_first=0),
                           start_profile=False)
        profiler.start()
        for _ in range(steps + 1):
            runner.train_step()
            profiler.step()
        profiler.stop()
        rows = read_summary(find_summary(folder), steps)
    return {row.op_type: row.ms_per_step for row in rows}


def rest_by_operator(operators: Dict[str, float]) -> Dict[str, float]:
    """The operators of the rest of a step (those outside the layers that oneDNN runs,
    ONEDNN_OPERATORS), ms per step: the NAMED_OPERATORS costliest by name, the others summed. (The
    time between operators is left out: the profiler slows it several-fold and its operators' own
    times by a little, so neither the profiled nor an unprofiled step gives it reliably.)"""
    others = sorted(((ms, name) for name, ms in operators.items() if not name.startswith(ONEDNN_OPERATORS)),
                    reverse=True)
    rest = {name: round(ms, 1) for ms, name in others[:NAMED_OPERATORS]}
    rest["other operators"] = round(sum(ms for ms, _ in others[NAMED_OPERATORS:]), 1)
    return rest


def _onednn_libraries() -> List[ctypes.CDLL]:
    """The oneDNN copies this process has loaded: MindSpore's, and our layers' (src/cpu_layers)."""
    import mindspore

    from src.cpu_layers.library import NATIVE_DIR
    paths = (os.path.join(os.path.dirname(mindspore.__file__), "lib", "libdnnl.so.3"),
             os.path.join(NATIVE_DIR, "libdnnl_resnet.so.3"))
    return [library for library in map(_already_loaded, paths) if library]


def _already_loaded(path: str) -> Optional[ctypes.CDLL]:
    """The shared library at `path` if this process has loaded it (our layers are not in every path)."""
    try:
        return ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
    except OSError:
        return None


@contextlib.contextmanager
def _onednn_profile() -> Iterator[Tuple[Callable[[bool], None], List[List[str]]]]:
    """oneDNN's execution profile (dnnl_set_verbose(1), ONEDNN_VERBOSE=profile_exec's lines) of the
    stretches inside between profile(True) and profile(False): its lines, which oneDNN prints to this
    process's stdout, go to a file instead (stdout is the orchestrator's pipe) and into the list
    yielded, one list of lines per stretch, once the block ends."""
    libraries, libc = _onednn_libraries(), ctypes.CDLL(None)
    stretches: List[List[str]] = []

    def profile(on: bool) -> None:
        for library in libraries:
            library.dnnl_set_verbose(1 if on else 0)
        if not on:  # oneDNN writes through stdio's buffer: flushed before the mark
            libc.fflush(None)
            os.write(1, (STRETCH_END + "\n").encode())

    with tempfile.TemporaryFile(mode="w+") as captured:
        libc.fflush(None)
        saved = os.dup(1)
        os.dup2(captured.fileno(), 1)
        for library in libraries:  # unprofiled until asked, whatever ONEDNN_VERBOSE says
            library.dnnl_set_verbose(0)
        try:
            yield profile, stretches
        finally:
            for library in libraries:
                library.dnnl_set_verbose(0)
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        captured.seek(0)
        stretch: List[str] = []
        for line in captured.read().splitlines():
            if line == STRETCH_END:
                stretches.append(stretch)
                stretch = []
            else:
                stretch.append(line)


def _milliseconds_by_kind(lines: List[str]) -> Dict[str, float]:
    """oneDNN's profiled primitives by kind (BREAKDOWN_KINDS, the others as 'other oneDNN'), ms."""
    totals: Dict[str, float] = {}
    for kind, _, _, milliseconds in _executions(lines):
        name = BREAKDOWN_KINDS.get(kind, "other oneDNN")
        totals[name] = totals.get(name, 0.0) + milliseconds
    return totals


def _executions(lines: List[str]) -> Iterator[Tuple[str, str, str, float]]:
    """(kind, propagation, problem, milliseconds) of each primitive oneDNN's profile timed: its lines
    "onednn_verbose,exec,cpu,KIND,IMPLEMENTATION,PROPAGATION,...,PROBLEM,MS"."""
    for line in lines:
        fields = line.split(",")
        if not line.startswith("onednn_verbose") or "exec" not in fields:
            continue
        at = fields.index("exec")
        try:
            milliseconds = float(fields[-1])
        except ValueError:
            continue
        yield fields[at + 2], fields[at + 4], fields[-2], milliseconds


def _multiply_accumulates(problem: str) -> int:
    """A 2-D convolution's multiply-accumulates from its problem in oneDNN's profile line, as
    "mb8_g32ic256oc256_ih56oh56kh3sh1dh0ph1_iw56ow56kw3sw1dw0pw1" (the group count absent when 1)."""
    sizes = {name: int(value) for name, value in re.findall(r"([a-z]+)(\d+)", problem)}
    return (sizes["mb"] * sizes["ic"] // sizes.get("g", 1) * sizes["oc"] * sizes["oh"] * sizes.get("ow", sizes["oh"])
            * sizes["kh"] * sizes.get("kw", sizes["kh"]))


def convolution_passes(lines: List[str]) -> Dict[str, Dict[str, float]]:
    """oneDNN's profiled convolutions by pass of the training step (CONVOLUTION_PASSES): each one's
    milliseconds, billions of multiply-accumulates and GMAC/s. Which pass falls short of the CPU's
    peak says where a step's convolutions could still gain. (The weight gradients of small maps that
    our layers compute as matrix products are among the breakdown's 'matrix products', with the
    head's, not here.)"""
    passes: Dict[str, List[float]] = {}
    for kind, propagation, problem, milliseconds in _executions(lines):
        if kind == "convolution" and propagation in CONVOLUTION_PASSES:
            totals = passes.setdefault(CONVOLUTION_PASSES[propagation], [0.0, 0.0])
            totals[0] += milliseconds
            totals[1] += _multiply_accumulates(problem) / 1e9
    return {name: {"ms": round(ms, 1), "gmac": round(gmac, 4), "gmacs_per_s": round(gmac * 1000 / ms, 1) if ms else 0.0}
            for name, (ms, gmac) in passes.items()}


def _timed_step(runner) -> float:
    start = time.perf_counter()
    runner.train_step()
    return (time.perf_counter() - start) * 1000


def onednn_breakdown(runner, steps: int = BREAKDOWN_STEPS) -> Tuple[Dict[str, float], Dict[str, Dict[str, float]]]:
    """A warm runner's training step taken apart, in milliseconds: oneDNN's primitives by kind
    (MindSpore's copy and ours both), and the rest of the step (MindSpore's own kernels, the
    optimizer, the framework). `steps` profiled and `steps` unprofiled steps run in turn; the step
    taken apart is the fastest profiled one (this host's neighbours only ever add time, to the
    primitives and the rest alike), and 'unprofiled_step_ms', the fastest unprofiled one, shows
    what oneDNN's profile itself costs (a line formatted and written per primitive: within this
    host's noise at ResNet18 64x32, where the steps of one run differ by 5-10%). Second, that step's
    convolutions by pass (convolution_passes)."""
    unprofiled, profiled = [], []
    with _onednn_profile() as (profile, stretches):
        for _ in range(steps):
            unprofiled.append(_timed_step(runner))
            profile(True)
            profiled.append(_timed_step(runner))
            profile(False)
    step_ms, lines = min(zip(profiled, stretches), key=lambda pair: pair[0])
    totals = _milliseconds_by_kind(lines)
    totals["the rest"] = step_ms - sum(totals.values())
    kinds = {"step_ms": round(step_ms, 1), **{name: round(value, 1) for name, value in totals.items()},
             "unprofiled_step_ms": round(min(unprofiled), 1)}
    return kinds, convolution_passes(lines)
