"""tools/layer_tape.py, the layer-by-layer comparison of two machines' kernels (docs/aarch64.md):
on one machine a replay equals its capture, and a planted ReLU mask flip is found and accounted for."""
import numpy as np
import pytest

from conftest import PYTHON, REPO, run
from tools.layer_tape import compare_tapes

pytestmark = pytest.mark.slow  # starts processes: not in the quick tier


@pytest.fixture(scope="module")
def tapes(tmp_path_factory, cifar_dir):
    folder = tmp_path_factory.mktemp("tape")
    tape, replay = folder / "tape.npz", folder / "replay.npz"
    for args in (["capture", str(tape), "--data_path", str(cifar_dir)], ["replay", str(tape), str(replay)]):
        result = run([PYTHON, str(REPO / "tools" / "layer_tape.py"), *args])
        assert result.returncode == 0, result.stderr[-3000:]
    return dict(np.load(tape)), dict(np.load(replay))


def test_each_layer_replayed_alone_on_the_same_machine_equals_the_capture(tapes):
    captured, replayed = tapes
    rows = compare_tapes(captured, replayed)
    assert [row.layer for row in rows][:2] == ["head", "layer4.1.relu"] and rows[-1].layer == "conv1"
    assert len(rows) == len(captured["order"]) == 67  # ResNet18: stem 4, 8 blocks, 3 downsamples, head
    assert all({"out", "dx0"} <= set(row.differences) for row in rows)
    assert max(max(row.differences.values()) for row in rows) < 1e-6
    assert not any(row.flips for row in rows)  # a replay has no inputs of its own


def test_a_flipped_relu_input_is_named_and_accounts_for_the_gradients_difference(tapes):
    captured, _ = tapes
    other = dict(captured)
    name = "layer2.1.relu"
    x = captured[f"{name}|in0"]
    index = tuple(int(i) for i in np.argwhere((x > 0) & (captured[f"{name}|dx0"] != 0))[0])
    flipped, gradient = x.copy(), captured[f"{name}|dx0"].copy()
    flipped[index], gradient[index] = -flipped[index], 0.0  # the other machine rounded it below zero
    other[f"{name}|in0"], other[f"{name}|dx0"] = flipped, gradient
    row = next(row for row in compare_tapes(captured, other) if row.layer == name)
    assert row.flips == [(index, float(x[index]), -float(x[index]))]
    assert row.rest == 0.0 and row.differences["dx0"] > 0
