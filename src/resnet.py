"""ResNet 18/34/50/101/152 (v1.5), ResNeXt and Wide ResNet with torchvision's structure and names,
and the MindSpore model zoo's SE-ResNet50 with the zoo's structure.

ResNeXt and Wide ResNet are the bottleneck ResNet with a wider, grouped 3x3 convolution
(torchvision's `groups` and `width_per_group`); one Bottleneck builds all three. SE-ResNet50
(`se-resnet50`) is built as the zoo builds it (SEResNet50 below), so the zoo's checkpoints give
the zoo's outputs.

Convolutions pad symmetrically (`pad_mode='pad'`, padding k//2), as torchvision does, so a
converted torchvision checkpoint gives the same outputs. BatchNorm uses MindSpore's names
(gamma, beta, moving_mean, moving_variance) and momentum 0.9 (PyTorch's 0.1).
"""
import math
from typing import List, NamedTuple, Optional, Tuple, Type, Union

import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common import initializer as init

from src.cpu_layers import IMPLEMENTATIONS, use_onednn_layers
from src.errors import UserInputError


class Arch(NamedTuple):
    """A network of the family: block kind, blocks per stage, 3x3 groups and width per group."""
    kind: str  # "basic" or "bottleneck"
    layers: List[int]
    groups: int = 1
    width_per_group: int = 64


ARCHS = {
    # Not in torchvision: one basic block per stage, for smoke tests, CI and small data (the
    # test suite's behaviour tests train it: half the graph to compile, a third the step time).
    "resnet10": Arch("basic", [1, 1, 1, 1]),
    "resnet18": Arch("basic", [2, 2, 2, 2]),
    "resnet34": Arch("basic", [3, 4, 6, 3]),
    # Not in torchvision either: one bottleneck per stage, resnet50's blocks in a quarter of its graph
    # (a quick trial of a bottleneck recipe; the suite's bottleneck exports).
    "resnet14": Arch("bottleneck", [1, 1, 1, 1]),
    "resnet50": Arch("bottleneck", [3, 4, 6, 3]),
    "resnet101": Arch("bottleneck", [3, 4, 23, 3]),
    "resnet152": Arch("bottleneck", [3, 8, 36, 3]),
    "resnext50_32x4d": Arch("bottleneck", [3, 4, 6, 3], groups=32, width_per_group=4),
    "resnext101_32x8d": Arch("bottleneck", [3, 4, 23, 3], groups=32, width_per_group=8),
    "resnext101_64x4d": Arch("bottleneck", [3, 4, 23, 3], groups=64, width_per_group=4),
    "wide_resnet50_2": Arch("bottleneck", [3, 4, 6, 3], width_per_group=128),
    "wide_resnet101_2": Arch("bottleneck", [3, 4, 23, 3], width_per_group=128),
}
# Networks of the model zoo built with its own structure (not torchvision's family above).
ZOO_NETWORKS = ("se-resnet50",)
NET_NAMES = tuple(ARCHS) + ZOO_NETWORKS
CONV_INITS = ("kaiming_normal", "XavierUniform", "TruncatedNormal")
DENSE_INITS = ("default", "TruncatedNormal", "RandomNormal")


def conv2d(in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
           groups: int = 1) -> nn.Conv2d:
    """A bias-free convolution with torchvision's symmetric padding."""
    return nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, pad_mode="pad",
                     padding=kernel_size // 2, has_bias=False, group=groups)


class Border(nn.Cell):
    """Adds one row and one column of `value` on each side of an NCHW tensor.

    Built from concatenations: MindSpore's CPU Pad kernel took 8-14x as long for the same
    result (e.g. 120 ms against 9 ms for an 8x64x112x112 tensor), 5% of a ResNet18 b64@32 step."""

    def __init__(self, value: float):
        super().__init__()
        self.value = value

    def construct(self, x):
        rows = ops.full_like(x[:, :, :1, :], self.value)
        x = ops.concat((rows, x, rows), 2)
        columns = ops.full_like(x[:, :, :, :1], self.value)
        return ops.concat((columns, x, columns), 3)


def batch_norm(channels: int, eps: float = 1e-5) -> nn.BatchNorm2d:
    """BatchNorm as torchvision's family has it (eps 1e-5); the model zoo's networks use ZOO_BN_EPS."""
    return nn.BatchNorm2d(channels, eps=eps, momentum=0.9)


class BasicBlock(nn.Cell):
    """Two 3x3 convolutions (ResNet18/34)."""
    expansion = 1
    # What follows each BatchNorm, for kernels that compute it in the same pass
    # (src.cpu_layers.use_onednn_layers); it sets `norms_activate` when they do.
    norm_activations = {"bn1": "relu", "bn2": "add_relu"}
    norms_activate = False

    def __init__(self, in_channels: int, channels: int, stride: int = 1,
                 downsample: Optional[nn.Cell] = None, groups: int = 1, width_per_group: int = 64):
        super().__init__()
        if groups != 1 or width_per_group != 64:
            raise ValueError("BasicBlock has no groups or width: use Bottleneck")
        self.conv1 = conv2d(in_channels, channels, 3, stride)
        self.bn1 = batch_norm(channels)
        self.conv2 = conv2d(channels, channels, 3)
        self.bn2 = batch_norm(channels)
        self.relu = nn.ReLU()
        self.downsample = downsample
        # A cell giving the two branches their own copies of the input, set by
        # src.cpu_layers.use_onednn_layers for bfloat16 layers (src.cpu_layers.elementwise.InputFork says why).
        self.input_fork = None

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2

    def construct(self, x):
        branch = x
        if isinstance(x, tuple):  # the prior block's output twice (src.cpu_layers.blocked_network.fork_block_outputs)
            x, branch = x
        elif self.input_fork is not None:
            x, branch = self.input_fork(x)
        identity = branch if self.downsample is None else self.downsample(branch)
        if self.norms_activate:
            return self.bn2(self.conv2(self.bn1(self.conv1(x))), identity)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


def bottleneck_width(channels: int, groups: int, width_per_group: int) -> int:
    """The channels of a Bottleneck's 3x3 convolution (ResNeXt and Wide ResNet widen it)."""
    return int(channels * (width_per_group / 64.0)) * groups


class Bottleneck(nn.Cell):
    """1x1 -> 3x3 (stride here, v1.5) -> 1x1 with 4x expansion (ResNet50/101/152).

    The 3x3 convolution has `groups` groups of `width_per_group` channels per 64 of `channels`:
    1 x 64 is ResNet, 32 x 4 ResNeXt50_32x4d, 1 x 128 Wide ResNet50_2 (as torchvision computes it)."""
    expansion = 4
    norm_activations = {"bn1": "relu", "bn2": "relu", "bn3": "add_relu"}  # as BasicBlock's
    norms_activate = False

    def __init__(self, in_channels: int, channels: int, stride: int = 1,
                 downsample: Optional[nn.Cell] = None, groups: int = 1, width_per_group: int = 64):
        super().__init__()
        out_channels = channels * self.expansion
        width = bottleneck_width(channels, groups, width_per_group)
        self.conv1 = conv2d(in_channels, width, 1)
        self.bn1 = batch_norm(width)
        self.conv2 = conv2d(width, width, 3, stride, groups)
        self.bn2 = batch_norm(width)
        self.conv3 = conv2d(width, out_channels, 1)
        self.bn3 = batch_norm(out_channels)
        self.relu = nn.ReLU()
        self.downsample = downsample
        self.input_fork = None  # as BasicBlock's

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3

    def construct(self, x):
        branch = x
        if isinstance(x, tuple):  # the prior block's output twice (src.cpu_layers.blocked_network.fork_block_outputs)
            x, branch = x
        elif self.input_fork is not None:
            x, branch = self.input_fork(x)
        identity = branch if self.downsample is None else self.downsample(branch)
        if self.norms_activate:
            out = self.bn2(self.conv2(self.bn1(self.conv1(x))))
            return self.bn3(self.conv3(out), identity)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


Block = Union[Type[BasicBlock], Type[Bottleneck]]


class Classifier(nn.Cell):
    """Global average pool and the fc head over a subclass's `forward_features`.

    Subclasses call `_add_head` last, so the head's parameters come last in the network's order
    (all_reduce_fusion_config indexes that order)."""

    def _add_head(self, features: int, num_classes: int) -> None:
        self.mean = ops.ReduceMean(keep_dims=False)
        self.fc = nn.Dense(features, num_classes)
        self.backbone_frozen = False  # set by train_head_only; a constant of the compiled graph
        # src.cpu_layers.use_onednn_layers sets a cell here: the features come out of a blocked layout.
        self.features_to_plain = None

    def construct(self, x):
        features = self.forward_features(x)
        if self.features_to_plain is not None:
            features = self.features_to_plain(features)
        features = self.mean(features, (2, 3))
        if self.backbone_frozen:
            # Cut here, so the backward pass ends at the head instead of crossing the backbone.
            features = ops.stop_gradient(features)
        return self.fc(features)


class ResNet(Classifier):
    """conv1/bn1/relu/maxpool stem, layer1..4, global average pool, fc."""
    norm_activations = {"bn1": "relu"}  # as BasicBlock's
    norms_activate = False
    # src.cpu_layers.use_onednn_layers may keep every tensor from the stem's convolution (which
    # reads the image) to the head in oneDNN's blocked layout: the stem pool is Border + MaxPool2d, the
    # head takes its features through features_to_plain.
    blocked_layers = {"stem": "conv1", "pool": "maxpool"}

    def __init__(self, block: Block, layers: List[int], num_classes: int = 1000, groups: int = 1,
                 width_per_group: int = 64):
        super().__init__()
        self.in_channels = 64
        self.groups, self.width_per_group = groups, width_per_group
        self.conv1 = conv2d(3, 64, 7, stride=2)
        self.bn1 = batch_norm(64)
        self.relu = nn.ReLU()
        # A border of -1 acts as torchvision's -inf padding: the input is post-ReLU (>= 0), so the
        # border never wins a window, forward or backward. (A zero border computed the same forward
        # pass but took the gradient of windows whose maximum is 0, which PyTorch gives to the first
        # real 0: train_parity.py found it. MaxPool2d's own padding lowers to MaxPool3DWithArgmax,
        # which ONNX export lacks; a finite value keeps int8 calibration ranges finite.)
        self.maxpool = nn.SequentialCell([Border(-1.0), nn.MaxPool2d(kernel_size=3, stride=2, pad_mode="valid")])
        self.layer1 = self._make_layer(block, 64, layers[0], stride=1)
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self._add_head(512 * block.expansion, num_classes)

    def _make_layer(self, block: Block, channels: int, blocks: int, stride: int) -> nn.SequentialCell:
        downsample = None
        out_channels = channels * block.expansion
        if stride != 1 or self.in_channels != out_channels:
            downsample = nn.SequentialCell([conv2d(self.in_channels, out_channels, 1, stride),
                                            batch_norm(out_channels)])
        shape = {"groups": self.groups, "width_per_group": self.width_per_group}
        cells = [block(self.in_channels, channels, stride, downsample, **shape)]
        self.in_channels = out_channels
        cells += [block(out_channels, channels, **shape) for _ in range(1, blocks)]
        return nn.SequentialCell(cells)

    def forward_features(self, x):
        """The stem and the four stages, before pooling."""
        x = self.bn1(self.conv1(x)) if self.norms_activate else self.relu(self.bn1(self.conv1(x)))
        x = self.maxpool(x)
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))


# ---------------------------------------------------------------------------------------------
# The model zoo's SE-ResNet50 (mindspore-ai/models official/cv/ResNet, `se_resnet50`, use_se=True).
# Its names are the zoo's except the two this repo renames for every zoo checkpoint
# (src/training/checkpoint.py ZOO_RENAMES): down_sample_layer -> downsample, end_point -> fc.

ZOO_BN_EPS = 1e-4  # the zoo's BatchNorm eps (this repo's torchvision family: 1e-5)


def same_conv(in_channels: int, out_channels: int, kernel_size: int, stride: int = 1) -> nn.Conv2d:
    """A bias-free convolution padded as the zoo pads (pad_mode='same': asymmetric at stride 2)."""
    return nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, pad_mode="same", has_bias=False)


def halving_pool() -> nn.MaxPool2d:
    """The 2x2/2 max-pool that does the stride of SE-ResNet50's downsampling blocks."""
    return nn.MaxPool2d(kernel_size=2, stride=2, pad_mode="same")


class SEBottleneck(nn.Cell):
    """The zoo's SE-ResNet50 bottleneck: 1x1 -> 3x3 -> 1x1 with 4x expansion, BN eps 1e-4.

    A downsampling block (stride 2) convolves at full size and halves with a 2x2 max-pool after
    the 3x3 (`e2`: conv, BN, ReLU, pool); its shortcut pools first, then a stride-1 1x1 conv + BN.
    With `squeeze_excite` the block rescales its channels (global average pool, se_dense_0 to a
    quarter of the channels, ReLU, se_dense_1, sigmoid) before the residual addition."""
    expansion = 4

    def __init__(self, in_channels: int, channels: int, stride: int = 1, squeeze_excite: bool = False):
        super().__init__()
        if stride not in (1, 2):
            raise ValueError(f"SEBottleneck strides by 1 or 2, not {stride}")
        out_channels = channels * self.expansion
        self.strided = stride == 2
        self.squeeze_excite = squeeze_excite
        self.conv1 = same_conv(in_channels, channels, 1)
        self.bn1 = batch_norm(channels, ZOO_BN_EPS)
        if self.strided:
            self.e2 = nn.SequentialCell([same_conv(channels, channels, 3), batch_norm(channels, ZOO_BN_EPS),
                                         nn.ReLU(), halving_pool()])
        else:
            self.conv2 = same_conv(channels, channels, 3)
            self.bn2 = batch_norm(channels, ZOO_BN_EPS)
        self.conv3 = same_conv(channels, out_channels, 1)
        self.bn3 = batch_norm(out_channels, ZOO_BN_EPS)
        if squeeze_excite:
            self.se_dense_0 = nn.Dense(out_channels, out_channels // 4)
            self.se_dense_1 = nn.Dense(out_channels // 4, out_channels)
            self.sigmoid = nn.Sigmoid()
        self.relu = nn.ReLU()
        self.downsample = self._shortcut(in_channels, out_channels)

    def _shortcut(self, in_channels: int, out_channels: int) -> Optional[nn.SequentialCell]:
        if self.strided:
            return nn.SequentialCell([halving_pool(), same_conv(in_channels, out_channels, 1),
                                      batch_norm(out_channels, ZOO_BN_EPS)])
        if in_channels != out_channels:
            return nn.SequentialCell([same_conv(in_channels, out_channels, 1), batch_norm(out_channels, ZOO_BN_EPS)])
        return None

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3

    def excite(self, x):
        """Channel weights from the pooled features, multiplied in."""
        scale = self.relu(self.se_dense_0(ops.mean(x, (2, 3))))
        scale = self.sigmoid(self.se_dense_1(scale))
        return x * ops.reshape(scale, scale.shape + (1, 1))

    def construct(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        if self.strided:
            out = self.e2(out)
        else:
            out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.squeeze_excite:
            out = self.excite(out)
        return self.relu(out + identity)


class SEResNet50(Classifier):
    """The zoo's SE-ResNet50: a three-conv stem (conv1_0 3x3/2 to 32, conv1_1 3x3 to 32, conv1_2
    3x3 to 64; bn1_0, bn1_1, bn1), a 3x3/2 max-pool, SEBottleneck stages of 3, 4, 6, 3 blocks in
    which only the last block of layer3 and of layer4 has squeeze-excitation, then pool and fc."""

    def __init__(self, num_classes: int = 1001):
        super().__init__()
        self.conv1_0 = same_conv(3, 32, 3, stride=2)
        self.bn1_0 = batch_norm(32, ZOO_BN_EPS)
        self.conv1_1 = same_conv(32, 32, 3)
        self.bn1_1 = batch_norm(32, ZOO_BN_EPS)
        self.conv1_2 = same_conv(32, 64, 3)
        self.bn1 = batch_norm(64, ZOO_BN_EPS)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, pad_mode="same")
        self.layer1 = self._make_layer(64, 64, 3, stride=1, squeeze_excite=False)
        self.layer2 = self._make_layer(256, 128, 4, stride=2, squeeze_excite=False)
        self.layer3 = self._make_layer(512, 256, 6, stride=2, squeeze_excite=True)
        self.layer4 = self._make_layer(1024, 512, 3, stride=2, squeeze_excite=True)
        self._add_head(512 * SEBottleneck.expansion, num_classes)

    @staticmethod
    def _make_layer(in_channels: int, channels: int, blocks: int, stride: int,
                    squeeze_excite: bool) -> nn.SequentialCell:
        """A stage; with `squeeze_excite` only its last block has it (the zoo's choice)."""
        out_channels = channels * SEBottleneck.expansion
        cells = [SEBottleneck(in_channels, channels, stride)]
        cells += [SEBottleneck(out_channels, channels) for _ in range(1, blocks - 1)]
        cells.append(SEBottleneck(out_channels, channels, squeeze_excite=squeeze_excite))
        return nn.SequentialCell(cells)

    def forward_features(self, x):
        """The stem and the four stages, before pooling."""
        x = self.relu(self.bn1_0(self.conv1_0(x)))
        x = self.relu(self.bn1_1(self.conv1_1(x)))
        x = self.maxpool(self.relu(self.bn1(self.conv1_2(x))))
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))


def _set(param: Parameter, values: np.ndarray) -> None:
    param.set_data(Tensor(values.astype(np.float32)))


def _initialize(net: Classifier, conv_init: str, dense_init: str, zero_init_residual: bool) -> None:
    """torchvision's init by default; the model zoo's choices by name."""
    conv_initializers = {
        "kaiming_normal": init.HeNormal(mode="fan_out", nonlinearity="relu"),
        "XavierUniform": init.XavierUniform(),
        "TruncatedNormal": init.TruncatedNormal(0.02),
    }
    for _, cell in net.cells_and_names():
        if isinstance(cell, nn.Conv2d):
            cell.weight.set_data(init.initializer(conv_initializers[conv_init], cell.weight.shape))
        elif isinstance(cell, nn.Dense):
            fan_in = cell.weight.shape[1]
            if dense_init == "default":  # PyTorch's nn.Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
                bound = 1.0 / math.sqrt(fan_in)
                cell.weight.set_data(init.initializer(init.Uniform(bound), cell.weight.shape))
                cell.bias.set_data(init.initializer(init.Uniform(bound), cell.bias.shape))
            else:
                weight_init = init.TruncatedNormal(0.01) if dense_init == "TruncatedNormal" \
                    else init.Normal(0.01)
                cell.weight.set_data(init.initializer(weight_init, cell.weight.shape))
                cell.bias.set_data(init.initializer("zeros", cell.bias.shape))
        elif isinstance(cell, (BasicBlock, Bottleneck, SEBottleneck)) and zero_init_residual:
            gamma = cell.last_bn.gamma
            _set(gamma, np.zeros(gamma.shape))


def freeze_batch_norm(net: nn.Cell) -> None:
    """BatchNorm normalizes with its moving statistics and stops updating them (gamma and beta
    still train): for small per-device batches, and to compare runs that split batches differently."""
    for _, cell in net.cells_and_names():
        if isinstance(cell, nn.BatchNorm2d):
            cell.use_batch_statistics = False


def train_head_only(net: Classifier) -> None:
    """Fine-tuning: only the classifier head (fc) trains. Every other parameter takes no gradient
    (optimizers and weight decay see only the head), every BatchNorm normalizes with its loaded
    statistics and leaves them as they are, and no gradient flows back into the backbone."""
    freeze_batch_norm(net)
    head = {id(param) for param in net.fc.get_parameters()}
    for param in net.get_parameters():
        if id(param) not in head:
            param.requires_grad = False
    net.backbone_frozen = True


def _torchvision_family(net_name: str, num_classes: int) -> ResNet:
    arch = ARCHS[net_name]
    block = BasicBlock if arch.kind == "basic" else Bottleneck
    return ResNet(block, arch.layers, num_classes, groups=arch.groups, width_per_group=arch.width_per_group)


def probe_layers(net_name: str, image_size: int, batch_size: int) -> List[Tuple[int, int, int, int, int, int]]:
    """A few of the network's own convolutions to time bfloat16 against float32 with
    (src.cpu_layers.choose_convolutions): each stage's 3x3 of a later block at its feature-map
    size, as (batch, in channels, input size, out channels, kernel, stride), the batch at most 16 (the
    two types compare alike at larger ones, and the probe stays well under a second). Ungrouped:
    ResNeXt's grouped 3x3s are timed as plain ones. SE-ResNet50 is timed as ResNet50."""
    if net_name not in NET_NAMES:
        raise UserInputError(f"unknown net_name '{net_name}'; choose one of {', '.join(NET_NAMES)}")
    arch = ARCHS.get(net_name, ARCHS["resnet50"])
    layers = []
    for stage in range(4):
        planes = 64 * 2 ** stage
        width = planes if arch.kind == "basic" else bottleneck_width(planes, arch.groups, arch.width_per_group)
        size = max(1, -(-image_size // (4 * 2 ** stage)))  # the stem and its pool halve it twice, each stage once more
        layers.append((min(batch_size, 16), width, size, width, 3, 1))
    return layers


def create_model(net_name: str, *, num_classes: int = 1000, conv_init: str = "kaiming_normal",
                 dense_init: str = "default", zero_init_residual: bool = False,
                 freeze_bn: bool = False, freeze_backbone: bool = False,
                 convolutions: str = "mindspore", initialize: bool = True) -> Classifier:
    """Build a network by name: a key of ARCHS ('resnet18' ... 'wide_resnet101_2') or the zoo's
    'se-resnet50'. `convolutions`: 'mindspore' (nn.Conv2d as it is), or on CPU this repository's
    oneDNN kernels, 'onednn' (float32) or 'onednn-bf16' (see src/cpu_layers and
    src.cpu_layers.choose_convolutions); the parameters are the same either way.
    `initialize` False leaves the cells' default values for a network whose every parameter is
    loaded next (a checkpoint, converted weights): drawing conv_init's and dense_init's took ~70%
    of the build (ResNet18 0.46 -> 0.15 s, ResNet50 0.98 -> 0.28 s, wide_resnet101_2 3.7-4.7 ->
    1.2-1.5 s)."""
    if net_name not in NET_NAMES:
        raise UserInputError(f"unknown net_name '{net_name}'; choose one of {', '.join(NET_NAMES)}")
    if conv_init not in CONV_INITS:
        raise UserInputError(f"unknown conv_init '{conv_init}'; choose one of {', '.join(CONV_INITS)}")
    if dense_init not in DENSE_INITS:
        raise UserInputError(f"unknown dense_init '{dense_init}'; choose one of {', '.join(DENSE_INITS)}")
    net = SEResNet50(num_classes) if net_name == "se-resnet50" else _torchvision_family(net_name, num_classes)
    if initialize:
        _initialize(net, conv_init, dense_init, zero_init_residual)
    if freeze_bn:
        freeze_batch_norm(net)
    if freeze_backbone:
        train_head_only(net)
    return use_convolutions(net, convolutions)


def check_convolutions(convolutions: str) -> None:
    """`convolutions` is one of src.cpu_layers.IMPLEMENTATIONS."""
    if convolutions not in IMPLEMENTATIONS:
        raise UserInputError(f"unknown convolutions '{convolutions}'; choose one of {', '.join(IMPLEMENTATIONS)}")


def use_convolutions(net: Classifier, convolutions: str) -> Classifier:
    """`net` (built with nn.Conv2d) computing with `convolutions`, in place: this repository's oneDNN
    layers swapped in for 'onednn' and 'onednn-bf16', nothing changed for 'mindspore'. Separate from
    create_model so that a network can change shape first (pruning narrows nn.Conv2d cells)."""
    check_convolutions(convolutions)
    if convolutions != "mindspore":
        use_onednn_layers(net, bf16=convolutions == "onednn-bf16")
    return net
