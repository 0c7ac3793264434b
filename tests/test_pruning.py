"""compression prune, first part: in-place L1 pruning of the residual blocks' inner channels."""
import mindspore as ms
import numpy as np
import pytest

from src.compression.prune import kept_channels, prune_blocks
from src.errors import UserInputError
from src.resnet import create_model
from src.training.model_summary import model_summary


def test_kept_channels_rounds_to_blocks_of_16():
    assert kept_channels(64, 0.5) == 32
    assert kept_channels(512, 0.5) == 256
    assert kept_channels(64, 0.7) == 16
    assert kept_channels(8, 0.5) == 4
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(UserInputError, match="prune_ratio"):
            kept_channels(64, bad)


@pytest.mark.parametrize("net_name", ["resnet18", "resnet50"])
def test_pruning_shrinks_and_keeps_shapes(net_name):
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    net = create_model(net_name, num_classes=10)
    net.set_train(False)
    before = model_summary(net, image_size=32)
    x = ms.Tensor(np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32))
    widths = prune_blocks(net, 0.5)
    after = model_summary(net, image_size=32)
    assert widths and all(w % 16 == 0 for w in widths)
    assert after["parameters"] < before["parameters"]
    assert after["gflops"] < before["gflops"]
    assert net(x).shape == (2, 10)
    names = [name for name, _ in net.parameters_and_names()]
    assert [p.name for p in net.get_parameters()] == names
    assert net.layer1[0].conv1.weight.shape[0] == widths[0]


def test_pruning_zero_filters_keeps_outputs():
    """Filters already zero (BatchNorm at its initial beta 0, mean 0) contribute nothing: removing
    them, which L1 ranking does first, leaves the network's outputs as they were."""
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    net = create_model("resnet18", num_classes=10)
    net.set_train(False)
    for cell in (c for _, c in net.cells_and_names() if hasattr(c, "downsample") and hasattr(c, "bn1")):
        weight = cell.conv1.weight.asnumpy().copy()
        weight[1::2] = 0.0
        cell.conv1.weight.set_data(ms.Tensor(weight))
    x = ms.Tensor(np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32))
    expected = net(x).asnumpy()
    prune_blocks(net, 0.5)
    np.testing.assert_allclose(net(x).asnumpy(), expected, rtol=1e-4, atol=1e-5)
