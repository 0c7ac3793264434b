"""ResNet's layers computed by this package's oneDNN kernels on CPU, with MindSpore's own Parameters:
the blocked network (max pool, the reorders back to NCHW, forks) and the two ways in.

Two ways to use them, both in place and keeping every Parameter, its name and checkpoints:
- `use_onednn_convolutions(net)`: every Conv2d becomes OneDnnConv2d; tensors stay NCHW between
  layers and each convolution reorders them in and out of oneDNN's layout. Any network.
- `use_onednn_layers(net)`: ResNet's convolutions, BatchNorms and the stem's max pool all run here
  and the tensors between them stay in oneDNN's blocked layout (the ReLUs and residual additions
  are computed by the BatchNorm kernels); the stem reads the NCHW image and the head gets NCHW features
  back. With `bf16` those tensors, and their gradients, are bfloat16 (in the NHWC layout AMX
  convolutions use). Networks whose layers do not allow it (SE-ResNet50's channel excitation) get
  the first way.
Export builds its own network without them, so MINDIR and ONNX files hold standard operators."""

import functools

import numpy as np
from mindspore import Tensor, nn, ops
from mindspore import dtype as mstype

from src.cpu_layers.convolution import _swap_convolution, supported, use_onednn_convolutions
from src.cpu_layers.custom_ops import (
    INPUT_BLOCKED,
    OUTPUT_BLOCKED,
    _aot,
    _of_input,
    _output_size,
    record,
)
from src.cpu_layers.library import channels_per_block
from src.cpu_layers.normalization import OneDnnBatchNorm2d, _swap_batch_norm, forked_batch_norm_op


@functools.lru_cache(maxsize=None)
def max_pool_ops(kernel: int, stride: int, pad: int) -> ops.Custom:
    """Max pooling of blocked tensors; padded positions never win a window."""
    def out_shape(x, params):
        return [x[0], x[1], _output_size(x[2], kernel, stride, 2 * pad, 1),
                _output_size(x[3], kernel, stride, 2 * pad, 1)]

    backward = _aot("PoolBackward", _of_input(0), _of_input(0))

    def bprop(x, params, out, dout):
        return backward(x, dout, params), ops.zeros_like(params)

    return _aot("PoolForward", out_shape, _of_input(0), bprop, shape_key=(kernel, stride, pad))


class OneDnnMaxPool(nn.SequentialCell):
    """The ResNet stem's [Border(-1), MaxPool2d(3, 2)] as one max pool of padding 1 on blocked
    tensors: the same windows, and the border never wins one (the input is post-ReLU)."""

    def construct(self, x):
        return self.onednn(x, self.onednn_params)


@functools.lru_cache(maxsize=None)
def to_plain_op(blocked_dtype: str) -> ops.Custom:
    """Blocked (of `blocked_dtype`, a mindspore.dtype name) -> NCHW float32; its gradient is the
    reorder back."""
    to_blocked = _aot("ToBlocked", _of_input(0), blocked_dtype)

    def bprop(x, out, dout):
        return (to_blocked(dout),)

    return _aot("ToPlain", _of_input(0), "float32", bprop)


class BlockedToPlain(nn.Cell):
    """The features of a blocked network back in NCHW float32, for the head."""

    def __init__(self, blocked_dtype: str):
        super().__init__()
        self.reorder = to_plain_op(blocked_dtype)

    def construct(self, x):
        return self.reorder(x)


def _twice(x):  # the outputs' shapes or types: the input's, twice
    return x, x


@functools.lru_cache(maxsize=None)
def fork_op() -> ops.Custom:
    """x -> two copies of x; the gradient is the sum of the two copies' gradients."""
    total = _aot("Sum", _of_input(0), _of_input(0))

    def bprop(x, out, dout):
        return (total(dout[0], dout[1]),)

    return _aot("Fork", _twice, _twice, bprop)


class InputFork(nn.Cell):
    """A block's input for its two branches, in training each its own copy: MindSpore sums the
    gradients of a tensor two operations read with AddN, which has no bfloat16 kernel on CPU; the
    copies' backward sums them in our kernel. In evaluation both branches read the input itself."""

    def __init__(self):
        super().__init__()
        self.fork = fork_op()

    def construct(self, x):
        if self.training:
            return self.fork(x)
        return x, x


def _blockable(net: nn.Cell, block: int) -> bool:
    """A network that declares its layers may run blocked (`blocked_layers`: its stem convolution,
    which reads the image, and its stem pool, Border + MaxPool2d; a head that takes its features
    through `features_to_plain`), whose convolutions and BatchNorms all have channels in whole
    blocks of `block` (the layout this CPU's convolutions choose; 0: none) and no bias."""
    declared = getattr(net, "blocked_layers", None)
    if not declared or block == 0:
        return False
    stem = getattr(net, declared["stem"])
    convolutions = [cell for _, cell in net.cells_and_names() if supported(cell)]
    norms = [cell for _, cell in net.cells_and_names() if type(cell) is nn.BatchNorm2d]
    return (supported(stem) and all(c.out_channels % block == 0 for c in convolutions)
            and all(c.in_channels % block == 0 for c in convolutions if c is not stem)
            and all(n.num_features % block == 0 for n in norms) and not any(c.has_bias for c in convolutions))


def _hand_activations_to_norms(cell: nn.Cell, dtype: mstype.Type) -> None:
    """A block (or stem) whose `norm_activations` name BatchNorms now running here: those compute
    the ReLU (and residual addition) that follows them, and the block's `norms_activate` says so.
    Saves MindSpore's element-wise passes over the tensor, forward and backward."""
    activations = getattr(cell, "norm_activations", None)
    if not activations or not all(isinstance(getattr(cell, name, None), OneDnnBatchNorm2d) for name in activations):
        return
    for name, activation in activations.items():
        _swap_batch_norm(getattr(cell, name), activation, dtype)
    cell.norms_activate = True


def fork_block_outputs(net: nn.Cell) -> int:
    """Every float32 residual block but the network's last hands its output to the next block twice
    in training (forked_batch_norm_op), one for the next block's first convolution, one for its
    shortcut; returns how many. Blocks take a pair as their input (src/resnet.py); evaluation and
    frozen BatchNorms hand out the one output."""
    blocks = [cell for _, cell in net.cells_and_names() if getattr(cell, "norms_activate", False)
              and hasattr(cell, "last_bn") and isinstance(cell.last_bn, OneDnnBatchNorm2d)]
    for block in blocks[:-1]:
        block.last_bn.onednn_forked = forked_batch_norm_op()
        block.last_bn.onednn_forks = True
    return max(len(blocks) - 1, 0)


def use_onednn_layers(net: nn.Cell, *, bf16: bool = False, fuse_activations: bool = True) -> str:
    """ResNet's layers in blocked layout (see the module's docstring) where the network allows it,
    else `use_onednn_convolutions`; returns which: 'blocked' or 'convolutions'. `bf16`: bfloat16
    tensors between the layers, the weights and their gradients float32. `fuse_activations`
    False leaves the ReLUs and residual additions to MindSpore (the same numbers, bit for bit:
    the kernels compute the very same float operations; the tests compare the two; float32 only,
    MindSpore's CPU ReLU has no bfloat16 kernel)."""
    blocked_dtype = "bfloat16" if bf16 else "float32"
    if not _blockable(net, channels_per_block(blocked_dtype)):
        use_onednn_convolutions(net, bf16=bf16)
        return "convolutions"
    if bf16 and not fuse_activations:
        raise ValueError("bfloat16 layers compute their activations themselves: fuse_activations must be True")
    dtype = getattr(mstype, blocked_dtype)
    stem = getattr(net, net.blocked_layers["stem"])
    for _, cell in net.cells_and_names():
        if supported(cell):
            layout = OUTPUT_BLOCKED if cell is stem else INPUT_BLOCKED | OUTPUT_BLOCKED
            _swap_convolution(cell, bf16=bf16, input_gradient=cell is not stem, layout=layout,
                              output_dtype=blocked_dtype)
        elif type(cell) is nn.BatchNorm2d:
            _swap_batch_norm(cell, dtype=dtype)
    if bf16:
        for block in [cell for _, cell in net.cells_and_names() if hasattr(cell, "input_fork")]:
            block.input_fork = InputFork()
    if fuse_activations:
        for _, cell in net.cells_and_names():
            _hand_activations_to_norms(cell, dtype)
        if not bf16:  # bfloat16 blocks fork their input instead (InputFork)
            fork_block_outputs(net)
    pool = getattr(net, net.blocked_layers["pool"])
    kernel, stride = (value if isinstance(value, int) else value[-1] for value in (pool[1].kernel_size, pool[1].stride))
    pool.onednn = max_pool_ops(kernel, stride, 1)
    pool.onednn_params = Tensor(np.array(record("PoolParams", kernel=kernel, stride=stride, pad=1), np.int32))
    pool.__class__ = OneDnnMaxPool
    net.features_to_plain = BlockedToPlain(blocked_dtype)
    return "blocked"
