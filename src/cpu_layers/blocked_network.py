"""A whole ResNet on this package's oneDNN kernels, with MindSpore's own Parameters: the network
kept in oneDNN's blocked layout from the stem to the head (its convolutions, BatchNorms with their
activations, the stem's max pool, the reorder back to NCHW, the forks).

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

import numpy as np
from mindspore import Tensor, nn
from mindspore import dtype as mstype

from src.cpu_layers.convolution import supported, swap_convolution, use_onednn_convolutions
from src.cpu_layers.custom_ops import INPUT_BLOCKED, OUTPUT_BLOCKED, record
from src.cpu_layers.elementwise import BlockedToPlain, InputFork
from src.cpu_layers.library import channels_per_block
from src.cpu_layers.normalization import OneDnnBatchNorm2d, forked_batch_norm_op, swap_batch_norm
from src.cpu_layers.pooling import OneDnnMaxPool, max_pool_ops


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
        swap_batch_norm(getattr(cell, name), activation, dtype)
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
            swap_convolution(cell, bf16=bf16, input_gradient=cell is not stem, layout=layout,
                              output_dtype=blocked_dtype)
        elif type(cell) is nn.BatchNorm2d:
            swap_batch_norm(cell, dtype=dtype)
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
