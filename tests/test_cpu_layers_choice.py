"""Which CPU layers a run gets: the config, the device and the library decide; amp on CPU times
float32 against bfloat16 on the host (or a capped ISA) and keeps the verdict; a build without a
compiler says why in one line (src/cpu_layers: choose_convolutions, bf16_choice)."""
import json
import os
import shutil
import subprocess

import pytest

from conftest import PYTHON, REPO, last_json, run
from cpu_layers_marks import needs_bf16_convolutions, needs_library
from src.cpu import cpu_flags, cpu_model
from src.cpu_layers import choose_convolutions, library
from src.cpu_layers.bf16_choice import bf16_verdict
from src.errors import UserInputError
from src.resnet import probe_layers


def test_the_choice_follows_the_config_the_device_and_the_library(monkeypatch, tmp_path):
    assert choose_convolutions("mindspore", device_target="CPU") == ("mindspore", None)
    assert choose_convolutions("onednn", device_target="Ascend") == ("mindspore", None)
    implementation, note = choose_convolutions("auto", device_target="CPU", optimizer="Thor")
    assert implementation == "mindspore" and "Thor" in note
    with pytest.raises(UserInputError, match="unknown cpu_convolution 'fast'"):
        choose_convolutions("fast", device_target="CPU")
    monkeypatch.setattr(library, "LIBRARY", str(tmp_path / "libresnet_conv.so"))  # not built
    implementation, note = choose_convolutions("auto", device_target="CPU")
    assert implementation == "mindspore" and "is not built" in note and "setup_env.sh" in note
    with pytest.raises(UserInputError, match="cpu_convolution onednn cannot run: .* is not built"):
        choose_convolutions("onednn", device_target="CPU")


def timing(float32_ms: float, bfloat16_ms: float):
    """A probe's timing function that measures nothing: each layer takes the given milliseconds."""
    def time_layer(*layer, bf16: bool) -> float:
        return bfloat16_ms if bf16 else float32_ms
    return time_layer


def not_timed(*layer, bf16: bool) -> float:
    raise AssertionError("timed again: the verdict should have come from the cache")


LAYERS = probe_layers("resnet18", 32, 64)


@needs_bf16_convolutions
@pytest.mark.parametrize("float32_ms, bfloat16_ms, expected", [
    (10.0, 5.0, "onednn-bf16"),   # AMX, AMD Zen 4: bf16 about twice as fast
    (10.0, 9.5, "onednn"),        # a near tie stays float32 (MARGIN)
    (10.0, 18.0, "onednn"),       # an Intel Xeon with AVX512_BF16 and no AMX
])
def test_amp_on_cpu_computes_bf16_where_the_networks_layers_run_faster_in_it(tmp_path, float32_ms, bfloat16_ms,
                                                                              expected):
    cache = str(tmp_path / "verdicts.json")
    ask = dict(device_target="CPU", amp_level="O2", probe_layers=LAYERS, cache_file=cache)
    implementation, note = choose_convolutions("auto", time_layer=timing(float32_ms, bfloat16_ms), **ask)
    assert implementation == expected and note
    # kept per CPU, ISA, threads and layers: the next run does not time again
    assert choose_convolutions("auto", time_layer=not_timed, **ask)[0] == expected
    verdict = bf16_verdict(LAYERS, cpu_model=cpu_model(), threads=0, cache_file=cache, time_layer=not_timed)
    assert verdict == (expected == "onednn-bf16", len(LAYERS) * float32_ms, len(LAYERS) * bfloat16_ms, True)
    try:  # another thread count is another probe
        with pytest.raises(AssertionError, match="timed again"):
            choose_convolutions("auto", threads=1, time_layer=not_timed, **ask)
    finally:
        library.set_threads(0)
    # either forced, untimed
    assert choose_convolutions("auto", cpu_amp_dtype="bfloat16", time_layer=not_timed, **ask)[0] == "onednn-bf16"
    assert choose_convolutions("auto", cpu_amp_dtype="float32", time_layer=not_timed, **ask)[0] == "onednn"
    assert choose_convolutions("auto", device_target="CPU", amp_level="O0", time_layer=not_timed) == ("onednn", None)


@needs_bf16_convolutions
def test_the_host_probe_times_the_layers_and_decides_by_its_timings(tmp_path):
    cache = tmp_path / "verdicts.json"
    implementation, note = choose_convolutions("auto", device_target="CPU", amp_level="O2", cache_file=str(cache),
                                               probe_layers=probe_layers("resnet50", 224, 8))
    (float32_ms, bfloat16_ms), = json.loads(cache.read_text()).values()
    assert float32_ms > 0 and bfloat16_ms > 0
    assert implementation == ("onednn-bf16" if bfloat16_ms < 0.9 * float32_ms else "onednn")
    assert f"{float32_ms:.1f} ms" in note and f"{bfloat16_ms:.1f} ms" in note  # the log line gives both timings


CAPPED_CHOICE = """
import json, sys
sys.path.insert(0, {repo!r})
from src.cpu_layers import choose_convolutions, library
from src.resnet import probe_layers
library.cap_isa(sys.argv[1])
choice, _ = choose_convolutions("auto", device_target="CPU", amp_level="O2", cache_file=sys.argv[2],
                                probe_layers=probe_layers("resnet18", 64, 8))
print(json.dumps({{"choice": choice, "float32": library.blocked_layout("float32"),
                  "bfloat16": library.blocked_layout("bfloat16"), "isa": library.isa_cap()}}))
"""


@needs_library
@pytest.mark.parametrize("isa", ["avx2", "avx512_core", "avx512_core_bf16"])
def test_a_capped_isa_asks_oneDNN_for_its_layouts_and_chooses_by_timing(tmp_path, isa):
    """The other CPUs the layers meet, emulated by capping the library's oneDNN: AVX2 (blocks of 8
    channels, no bfloat16), AVX-512 without BF16, AVX512_BF16 without AMX (bfloat16 blocked as float32)."""
    if isa != "avx2" and "avx512f" not in cpu_flags():
        pytest.skip("this CPU has no AVX-512")
    cache = tmp_path / "verdicts.json"
    result = run([PYTHON, "-c", CAPPED_CHOICE.format(repo=str(REPO)), isa, str(cache)])
    assert result.returncode == 0, result.stderr[-2000:]
    found = last_json(result.stdout)
    assert found["isa"] == isa
    assert found["float32"] == ("nChw8c" if isa == "avx2" else "nChw16c")
    if found["bfloat16"] == "":
        assert found["choice"] == "onednn" and not cache.exists()   # no bfloat16 convolutions: nothing to time
    else:
        (float32_ms, bfloat16_ms), = json.loads(cache.read_text()).values()
        assert found["choice"] == ("onednn-bf16" if bfloat16_ms < 0.9 * float32_ms else "onednn")


def test_the_build_says_why_in_one_line_without_a_compiler(tmp_path):
    native = tmp_path / "native"
    shutil.copytree(REPO / "src" / "cpu_layers" / "native", native,
                    ignore=shutil.ignore_patterns("*.so", "*.so.3", "build.log"))
    venv = REPO / ".venv"
    env = dict(os.environ, CXX="no-such-g++")  # a compiler that is not on PATH
    result = subprocess.run(["/bin/bash", str(native / "build.sh"), str(venv)], env=env, capture_output=True,
                            text=True)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "did not build" in lines[0] and "uses MindSpore's convolutions" in lines[0]
    assert not (native / "libresnet_conv.so").exists()
