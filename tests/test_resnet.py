"""src/resnet.py: torchvision-compatible ResNet structure, names, sizes, init and padding."""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from conftest import needs_torch
from src.errors import UserInputError
from src.resnet import ARCHS, CONV_INITS, DENSE_INITS, Border, create_model

BN_FIELDS = ("gamma", "beta", "moving_mean", "moving_variance")
_MODELS = {}


def model(name, **kwargs):
    """Models built once per test session (building is the slow part)."""
    key = (name, tuple(sorted(kwargs.items())))
    if key not in _MODELS:
        _MODELS[key] = create_model(name, **kwargs)
    return _MODELS[key]


def expected_names(net_name):
    """torchvision's state-dict names (without num_batches_tracked), BatchNorm in MindSpore's terms."""
    kind, layers = ARCHS[net_name].kind, ARCHS[net_name].layers
    convs = 2 if kind == "basic" else 3
    names = {"conv1.weight", "fc.weight", "fc.bias"} | {f"bn1.{f}" for f in BN_FIELDS}
    for stage, blocks in enumerate(layers, start=1):
        for block in range(blocks):
            prefix = f"layer{stage}.{block}"
            for i in range(1, convs + 1):
                names.add(f"{prefix}.conv{i}.weight")
                names |= {f"{prefix}.bn{i}.{f}" for f in BN_FIELDS}
            # every stage's first block changes the shape, except layer1 of BasicBlock nets
            if block == 0 and (stage > 1 or kind == "bottleneck"):
                names.add(f"{prefix}.downsample.0.weight")
                names |= {f"{prefix}.downsample.1.{f}" for f in BN_FIELDS}
    return names


def test_resnet50_parameter_counts():
    net = model("resnet50", num_classes=1000)
    params = list(net.get_parameters())
    trainable = net.trainable_params()
    assert len(params) == 267
    assert len(trainable) == 161
    assert sum(int(np.prod(p.shape)) for p in trainable) == 25_557_032


def test_resnet18_parameter_count():
    net = model("resnet18", num_classes=1000)
    assert sum(int(np.prod(p.shape)) for p in net.trainable_params()) == 11_689_512
    assert len(net.trainable_params()) == 62


def test_class_num_sets_the_head():
    net = model("resnet18", num_classes=10)
    assert tuple(net.fc.weight.shape) == (10, 512)
    assert tuple(net.fc.bias.shape) == (10,)


# torchvision's parameter counts at 1000 classes.
WIDER = {"resnext50_32x4d": 25_028_904, "resnext101_32x8d": 88_791_336, "resnext101_64x4d": 83_455_272,
         "wide_resnet50_2": 68_883_240, "wide_resnet101_2": 126_886_696}


@pytest.mark.slow
def test_resnext_and_wide_resnet_match_torchvision_counts_and_shapes():
    """Each built once (the 101-layer ones hold 83-127M parameters) without the initial draw, which
    none of this reads: count, names, a forward pass."""
    x = Tensor(np.zeros((1, 3, 32, 32), np.float32))
    for net_name, count in WIDER.items():
        net = create_model(net_name, num_classes=1000, initialize=False)
        assert sum(int(np.prod(p.shape)) for p in net.trainable_params()) == count, net_name
        assert {p.name for p in net.get_parameters()} == expected_names(net_name)
        assert net(x).shape == (1, 1000)
        del net


@pytest.mark.parametrize("net_name, width, groups", [("resnext50_32x4d", 128, 32), ("wide_resnet50_2", 128, 1),
                                                     ("resnet50", 64, 1)])
@pytest.mark.slow
def test_the_3x3_convolution_is_grouped_and_widened(net_name, width, groups):
    """layer1's bottleneck: width = 64 * width_per_group / 64 * groups, the 3x3 split in `groups`."""
    block = model(net_name, num_classes=10).layer1[0]
    assert tuple(block.conv1.weight.shape) == (width, 64, 1, 1)
    assert tuple(block.conv2.weight.shape) == (width, width // groups, 3, 3)
    assert block.conv2.group == groups
    assert tuple(block.conv3.weight.shape) == (256, width, 1, 1)


@pytest.mark.slow
@pytest.mark.parametrize("net_name", [n for n in ARCHS if n not in WIDER] + ["resnext50_32x4d"])
def test_output_shape(net_name):
    net = model(net_name, num_classes=10)
    x = Tensor(np.random.default_rng(0).standard_normal((2, 3, 64, 64)).astype(np.float32))
    out = net(x).asnumpy()
    assert out.shape == (2, 10)
    assert out.dtype == np.float32
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("net_name", ["resnet18", "resnet50"])
def test_parameter_names_follow_torchvision(net_name):
    names = [p.name for p in model(net_name, num_classes=1000).get_parameters()]
    assert len(names) == len(set(names))
    assert set(names) == expected_names(net_name)
    assert not [n for n in names if "num_batches_tracked" in n]


def test_some_torchvision_names_by_hand():
    names = {p.name for p in model("resnet50", num_classes=1000).get_parameters()}
    for name in ["conv1.weight", "bn1.gamma", "bn1.beta", "bn1.moving_mean", "bn1.moving_variance",
                 "layer1.0.conv1.weight", "layer2.0.downsample.0.weight", "layer2.0.downsample.1.gamma",
                 "layer4.2.bn3.gamma", "fc.weight", "fc.bias"]:
        assert name in names
    trainable = {p.name for p in model("resnet50", num_classes=1000).trainable_params()}
    assert "bn1.moving_mean" not in trainable and "bn1.gamma" in trainable


def test_resnet50_is_v1_5_stride_in_the_3x3_conv():
    net = model("resnet50", num_classes=1000)
    block = net.layer2[0]
    assert tuple(block.conv1.stride)[-2:] == (1, 1)
    assert tuple(block.conv2.stride)[-2:] == (2, 2)
    assert tuple(block.downsample[0].stride)[-2:] == (2, 2)
    # and by shape: the 1x1 keeps 8x8, the 3x3 halves it
    x = Tensor(np.ones((1, 256, 8, 8), np.float32))
    after1 = block.conv1(x)
    assert after1.shape == (1, 128, 8, 8)
    assert block.conv2(after1).shape == (1, 128, 4, 4)


def last_bn_names(net_name):
    kind, layers = ARCHS[net_name].kind, ARCHS[net_name].layers
    last = "bn2" if kind == "basic" else "bn3"
    return {f"layer{s}.{b}.{last}.gamma" for s, n in enumerate(layers, start=1) for b in range(n)}


@pytest.mark.slow
@pytest.mark.parametrize("net_name", ["resnet18", "resnet50"])
def test_zero_init_residual(net_name):
    zeroed = last_bn_names(net_name)
    net = model(net_name, num_classes=10, zero_init_residual=True)
    gammas = {p.name: p.asnumpy() for p in net.get_parameters() if p.name.endswith(".gamma")}
    assert zeroed <= set(gammas)
    for name, value in gammas.items():
        if name in zeroed:
            assert np.all(value == 0), name
        else:
            assert np.all(value == 1), name
    default = model(net_name, num_classes=10)
    assert all(np.all(p.asnumpy() == 1) for p in default.get_parameters() if p.name.endswith(".gamma"))


def test_batch_norm_starts_at_identity():
    net = model("resnet18", num_classes=10)
    for p in net.get_parameters():
        if p.name.endswith((".beta", ".moving_mean")):
            assert np.all(p.asnumpy() == 0), p.name
        elif p.name.endswith(".moving_variance"):
            assert np.all(p.asnumpy() == 1), p.name


@pytest.mark.slow
@pytest.mark.parametrize("conv_init", CONV_INITS)
@pytest.mark.parametrize("dense_init", DENSE_INITS)
def test_init_options_give_valid_parameters(conv_init, dense_init):
    net = create_model("resnet18", num_classes=10, conv_init=conv_init, dense_init=dense_init)
    for p in net.trainable_params():
        value = p.asnumpy()
        assert np.all(np.isfinite(value)), p.name
    conv = net.conv1.weight.asnumpy()  # fan_in 3*7*7 = 147, fan_out 64*7*7 = 3136
    if conv_init == "kaiming_normal":
        assert conv.std() == pytest.approx(np.sqrt(2 / 3136), rel=0.1)
        assert abs(conv.mean()) < 0.003
    elif conv_init == "XavierUniform":
        bound = np.sqrt(6 / (147 + 3136))
        assert np.abs(conv).max() <= bound + 1e-7
        assert conv.std() == pytest.approx(bound / np.sqrt(3), rel=0.1)
    else:
        assert 0.015 < conv.std() < 0.021
    weight, bias = net.fc.weight.asnumpy(), net.fc.bias.asnumpy()
    if dense_init == "default":
        bound = 1 / np.sqrt(512)
        assert np.abs(weight).max() <= bound + 1e-7 and np.abs(bias).max() <= bound + 1e-7
        assert weight.std() == pytest.approx(bound / np.sqrt(3), rel=0.15)
        assert np.any(bias != 0)
    else:
        assert np.all(bias == 0)
        assert weight.std() == pytest.approx(0.01, rel=0.2)


@pytest.mark.parametrize("kwargs,word", [
    ({"net_name": "resnet20"}, "resnet20"),
    ({"net_name": "resnet50", "conv_init": "he_normal"}, "he_normal"),
    ({"net_name": "resnet50", "dense_init": "zeros"}, "zeros"),
])
def test_unknown_options_raise(kwargs, word):
    with pytest.raises(UserInputError, match=word):
        create_model(**kwargs)


def correlate_reference(x, w, stride, pad_before, pad_after):
    """Plain cross-correlation (NCHW x OIHW) with zero padding, in float64."""
    pads = (pad_before, pad_after)
    x = np.pad(x.astype(np.float64), ((0, 0), (0, 0), pads, pads))
    n, _, h, wd = x.shape
    o, _, k, _ = w.shape
    out_h, out_w = (h - k) // stride + 1, (wd - k) // stride + 1
    out = np.zeros((n, o, out_h, out_w))
    for i in range(out_h):
        for j in range(out_w):
            patch = x[:, :, i * stride:i * stride + k, j * stride:j * stride + k]
            out[:, :, i, j] = np.tensordot(patch, w.astype(np.float64), axes=([1, 2, 3], [1, 2, 3]))
    return out


@pytest.mark.parametrize("which", ["stem7x7", "block3x3", "downsample1x1"])
def test_stride_2_convolutions_pad_symmetrically(which):
    net = model("resnet18", num_classes=10)
    conv, channels = {"stem7x7": (net.conv1, 3), "block3x3": (net.layer2[0].conv1, 64),
                      "downsample1x1": (net.layer2[0].downsample[0], 64)}[which]
    # an even side: 'same' padding would pad one more row/column at the bottom/right than at the top/left
    x = np.random.default_rng(1).standard_normal((1, channels, 10, 10)).astype(np.float32)
    w = conv.weight.asnumpy()
    got = conv(Tensor(x)).asnumpy()
    pad = w.shape[-1] // 2
    want = correlate_reference(x, w, 2, pad, pad)
    assert got.shape == want.shape == (1, w.shape[0], 5, 5)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # the asymmetric ('same') alternative differs, so the comparison above can tell them apart
    if pad:
        same = correlate_reference(x, w, 2, pad - 1, pad)
        assert same.shape == want.shape
        assert np.abs(same - want).max() > 1e-2


def test_stem_max_pool_pads_one_pixel_on_every_side():
    net = model("resnet18", num_classes=10)
    x = np.random.default_rng(2).random((2, 3, 6, 7)).astype(np.float32)  # post-ReLU: >= 0
    bordered = net.maxpool[0](Tensor(x)).asnumpy()
    np.testing.assert_array_equal(bordered, np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-1.0))
    # torchvision's MaxPool2d(3, 2, padding=1) output size on a 6x7 input
    assert net.maxpool(Tensor(x)).shape == (2, 3, 3, 4)


@needs_torch
def test_stem_pool_sends_gradients_where_pytorchs_does():
    import torch

    """The defect train_parity.py found: with a zero border, windows whose maximum is 0 (ReLU's
    floor) gave their gradient to the border; PyTorch gives it to the first real 0."""
    rng = np.random.default_rng(0)
    x = np.maximum(rng.standard_normal((2, 4, 12, 12)), 0).astype(np.float32)
    grad_out = rng.standard_normal((2, 4, 6, 6)).astype(np.float32)
    pool = model("resnet18", num_classes=10).maxpool
    assert isinstance(pool[0], Border)
    ms_grad = ms.grad(lambda inputs: (pool(inputs) * Tensor(grad_out)).sum())(Tensor(x)).asnumpy()
    inputs = torch.from_numpy(x).requires_grad_(True)
    (torch.nn.MaxPool2d(3, 2, 1)(inputs) * torch.from_numpy(grad_out)).sum().backward()
    assert np.abs(inputs.grad.numpy() - ms_grad).max() < 1e-6
    assert (x == 0).mean() > 0.4  # the case: many zeros


def test_a_network_built_for_loading_has_the_same_parameters_without_the_draw():
    """initialize=False (checkpoints and converted weights fill every parameter next) builds the
    same parameters, but skips conv_init's draw: conv1 (64 x 3 x 7 x 7) keeps nn.Conv2d's default
    instead of kaiming normal with fan_out, std sqrt(2 / (64 * 49)) = 0.0255."""
    drawn = create_model("resnet10", num_classes=10)
    bare = create_model("resnet10", num_classes=10, initialize=False)
    assert {p.name: p.shape for p in bare.get_parameters()} == {p.name: p.shape for p in drawn.get_parameters()}
    assert float(drawn.conv1.weight.asnumpy().std()) == pytest.approx(0.0255, rel=0.1)
    assert float(bare.conv1.weight.asnumpy().std()) != pytest.approx(0.0255, rel=0.1)
