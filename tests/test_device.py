"""The device set-up: the speed-up of compiled calls (nn.Cell's compile_phase setter, quicker, with
the values MindSpore's own sets) and the refusal of MindSpore's compile cache."""
import os

import mindspore as ms
import numpy as np
import pytest

from conftest import PYTHON, REPO, run
from src.device import COMPILE_CACHE_SWITCH, MINDSPORE_COMPILE_PHASE, quicken_compiled_calls, refuse_compile_cache
from src.errors import UserInputError
from src.resnet import create_model


def phases(net: ms.nn.Cell) -> dict:
    """Each cell's compile phase by name, the network itself as ''."""
    return {name: cell._compile_phase for name, cell in net.cells_and_names()}  # noqa: SLF001


def test_the_quicker_setter_writes_what_mindspores_writes():
    quicken_compiled_calls()
    assert ms.nn.Cell.compile_phase is not MINDSPORE_COMPILE_PHASE
    theirs, ours = create_model("resnet10", num_classes=10), create_model("resnet10", num_classes=10)
    theirs.layer1[0].downsample = None  # a None in the tree, which both skip
    ours.layer1[0].downsample = None
    MINDSPORE_COMPILE_PHASE.fset(theirs, "train.1")
    ours.compile_phase = "train.1"
    assert phases(ours) == phases(theirs) and set(phases(ours).values()) == {"train.1"}
    assert len(phases(ours)) == 45  # every cell below (resnet10 has 45), not the top alone
    ours.layer2.compile_phase = "predict.2"  # a sub-network called alone sets its own cells only
    assert {name for name, phase in phases(ours).items() if phase == "predict.2"} == {
        name for name in phases(ours) if name.startswith("layer2")}
    with pytest.raises(TypeError, match="compile_phase"):
        ours.compile_phase = 1
    quicken_compiled_calls()  # again: still the one property
    assert ms.nn.Cell.compile_phase.fset is type(ours).compile_phase.fset


def test_a_compiled_network_computes_alike_with_the_quicker_setter():
    quicken_compiled_calls()
    net = create_model("resnet10", num_classes=10, convolutions="mindspore")
    net.set_train(False)
    images = ms.Tensor(np.random.default_rng(0).random((2, 3, 32, 32), dtype=np.float32))
    mode = ms.get_context("mode")
    try:
        ms.set_context(mode=ms.GRAPH_MODE)
        first, second = net(images).asnumpy(), net(images).asnumpy()  # compiled, then the compiled graph reused
        ms.set_context(mode=ms.PYNATIVE_MODE)
        eager = net(images).asnumpy()
    finally:
        ms.set_context(mode=mode)
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(first, eager, rtol=1e-5, atol=1e-5)
    assert net.compile_phase and net.layer1[0].conv1.compile_phase == net.compile_phase


def test_every_entry_points_device_set_up_installs_it_and_runs_cpu_ops_synchronously():
    """init_device (train.py, eval.py, export.py, predict.py, the benchmark's workers) installs the
    setter and, on CPU, MindSpore's synchronous launch; in a process of its own, since MindSpore takes
    the device once, before any kernel."""
    script = ("import mindspore as ms\nfrom mindspore._c_expression import RuntimeConf\n"
              "from src.device import MINDSPORE_COMPILE_PHASE, init_device\n"
              "def state(): return ms.nn.Cell.compile_phase is MINDSPORE_COMPILE_PHASE, "
              "RuntimeConf.get_instance().is_launch_blocking()\n"
              "before = state()\ninit_device('CPU')\nprint(*before, *state())")
    result = run([PYTHON, "-c", script])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-4:] == ["True", "False", "False", "True"]


@pytest.mark.parametrize("value, refused", [("1", True), (" 1\n", True), ("0", False), ("", False), (None, False)])
def test_the_compile_cache_switch_is_refused_where_it_is_on(value, refused):
    environ = {} if value is None else {COMPILE_CACHE_SWITCH: value}
    if refused:
        with pytest.raises(UserInputError, match=f"unset {COMPILE_CACHE_SWITCH}"):
            refuse_compile_cache(environ)
    else:
        refuse_compile_cache(environ)


@pytest.mark.slow
def test_train_py_with_the_compile_cache_on_is_one_line_and_writes_nothing(tmp_path, cifar_dir):
    """MindSpore's compile cache would run a graph compiled for other settings (src/device.py)."""
    out, cache = tmp_path / "out", tmp_path / "cache"
    env = dict(os.environ, **{COMPILE_CACHE_SWITCH: "1", "MS_COMPILER_CACHE_PATH": str(cache)})
    result = run([PYTHON, "train.py", "--config_path", str(REPO / "config" / "sample_resnet18.yaml"),
                  "--net_name", "resnet10", "--data_path", str(cifar_dir), "--epoch_size", "1",
                  "--output_dir", str(out)], env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {COMPILE_CACHE_SWITCH}=1 ") and line.endswith(f"unset {COMPILE_CACHE_SWITCH}")
    assert not out.exists() and not cache.exists()
