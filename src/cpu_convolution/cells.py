"""ResNet's layers computed by this package's oneDNN kernels on CPU, with MindSpore's own Parameters.

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
from typing import Tuple

import numpy as np
from mindspore import Tensor, nn, ops
from mindspore import dtype as mstype
from mindspore.ops import signature as sig

from src.cpu_convolution.library import LIBRARY, RECORDS, channels_per_block, weight_matrix_elements

INPUT_BLOCKED, OUTPUT_BLOCKED = 1, 2  # native/core.hpp's ConvParams.layout bits


def record(name: str, **fields) -> Tuple:
    """The parameter record `name` (library.RECORDS) from its fields by name, in the library's order."""
    order = RECORDS[name]
    if set(fields) != set(order):
        raise ValueError(f"{name} takes the fields {', '.join(order)}; got {', '.join(sorted(fields))}")
    return tuple(fields[field] for field in order)


def _aot(name: str, out_shape, out_dtype, bprop=None, shape_key: Tuple = ()) -> ops.Custom:
    """The library's kernel `name` as an op. MindSpore takes an op of the same kernel and input
    shapes and types for the same op, whatever its out_shape and out_dtype functions (a float32
    ToBlocked and a bfloat16 one in one process; a stride-1 and a stride-2 convolution of one input):
    what tells them apart goes in attributes too. `out_dtype` a mindspore.dtype name: every output of
    that type; `shape_key`: the parameters the output's shape depends on."""
    fixed = isinstance(out_dtype, str)
    op = ops.Custom(f"{LIBRARY}:{name}", out_shape=out_shape, out_dtype=_fixed_dtype(out_dtype) if fixed else out_dtype,
                    func_type="aot", bprop=bprop)
    if fixed:
        op.add_prim_attr("output_dtype", out_dtype)
    if shape_key:
        op.add_prim_attr("output_shape_of", ",".join(map(str, shape_key)))
    return op


def _fixed_dtype(name: str):
    def dtype(*dtypes):
        return getattr(mstype, name)
    return dtype


def _of_input(index: int):
    """out_shape or out_dtype: the shape or type of input `index`."""
    def of_input(*shapes_or_dtypes):
        return shapes_or_dtypes[index]
    return of_input


def _output_size(size: int, kernel: int, stride: int, pad: int, dilation: int) -> int:
    return (size + pad - dilation * (kernel - 1) - 1) // stride + 1


@functools.lru_cache(maxsize=None)
def convolution_ops(params: Tuple[int, ...], kernel: Tuple[int, int], input_gradient: bool,
                    output_dtype: str = "") -> ops.Custom:
    """The forward Custom op for one convolution's parameters, with its backward ops as bprop.
    `input_gradient` False: the input's gradient is zeros (the stem, whose input is the image).
    `output_dtype`: the output's type (a mindspore.dtype name), else the input's.
    The op returns (output, matrix): where the layer runs as one dense matrix product, or its image
    lies inside the kernel (the library's WeightMatrixElements), its training forward writes there
    what it makes of the weights (the matrix, the taps that meet the image) and the bprop hands that
    to the image gradient's kernel, which then does not make it again; else one unused float."""
    stride_h, stride_w, top, bottom, left, right, dilation_h, dilation_w = params[:8]

    def forward_shape(x, w, p):
        if top < 0:  # 'same'
            y = [x[0], w[0], -(-x[2] // stride_h), -(-x[3] // stride_w)]
        else:
            y = [x[0], w[0], _output_size(x[2], kernel[0], stride_h, top + bottom, dilation_h),
                 _output_size(x[3], kernel[1], stride_w, left + right, dilation_w)]
        return y, [max(weight_matrix_elements(x, w, y, params), 1)]

    def forward_dtypes(x, w, p):
        return (getattr(mstype, output_dtype) if output_dtype else x), mstype.float32

    backward_data = _aot("ConvBackwardData", _of_input(3), _of_input(3))
    backward_weights = _aot("ConvBackwardWeights", _of_input(3), _of_input(3))

    def bprop(x, w, p, out, dout):
        dy = dout[0]
        dx = backward_data(dy, w, p, x, out[1]) if input_gradient else ops.zeros_like(x)
        return dx, backward_weights(x, dy, p, w), ops.zeros_like(p)

    forward = _aot("ConvForward", forward_shape, forward_dtypes, bprop, shape_key=params + kernel)
    forward.add_prim_attr("output_dtype", output_dtype or "input")
    return forward


def convolution_params(conv: nn.Conv2d, bf16: bool = False, layout: int = 0,
                       inference: bool = False) -> Tuple[int, ...]:
    """stride, padding (top, bottom, left, right; -1: 'same'), dilation, groups, the bf16 flag, the
    layout bits and the inference flag of `conv`: native/core.hpp's ConvParams."""
    padding = conv.padding if conv.pad_mode == "pad" else 0
    if conv.pad_mode == "same":  # the kernels work the padding out from the input's size
        padding = -1
    top, bottom, left, right = (padding,) * 4 if isinstance(padding, int) else tuple(padding)
    stride, dilation = conv.stride[-2:], conv.dilation[-2:]
    return record("ConvParams", stride_h=stride[0], stride_w=stride[1], pad_top=top, pad_bottom=bottom,
                  pad_left=left, pad_right=right, dilation_h=dilation[0], dilation_w=dilation[1], groups=conv.group,
                  bf16=int(bf16), layout=layout, inference=int(inference))


def supported(cell: nn.Cell) -> bool:
    """nn.Conv2d itself (not a subclass such as THOR's) on NCHW tensors."""
    return type(cell) is nn.Conv2d and cell.data_format == "NCHW"


class OneDnnConv2d(nn.Conv2d):
    """A Conv2d whose three kernels are this package's. Inputs of another float type (amp) are
    computed in float32 and returned in their own type; between blocked layers (`onednn_blocked`,
    a constant of the graph) the tensors are in the types the layers hand each other, uncast. In
    evaluation mode the forward keeps the weights' reorder while they are frozen (library.freeze_weights)."""

    def construct(self, x):
        if self.training:
            convolve, params = self.onednn, self.onednn_params
        else:
            convolve, params = self.onednn_inference, self.onednn_inference_params
        if self.onednn_blocked:
            return convolve(x, self.weight, params)[0]
        dtype = x.dtype
        y = convolve(ops.cast(x, mstype.float32), ops.cast(self.weight, mstype.float32), params)[0]
        y = ops.cast(y, dtype)
        if self.has_bias:
            y = self.bias_add(y, self.bias)
        return y


def _swap_convolution(cell: nn.Conv2d, *, bf16: bool, input_gradient: bool, layout: int = 0,
                      output_dtype: str = "") -> None:
    params = convolution_params(cell, bf16, layout)
    inference_params = convolution_params(cell, bf16, layout, inference=True)
    cell.onednn = convolution_ops(params, tuple(cell.kernel_size), input_gradient, output_dtype)
    cell.onednn_inference = convolution_ops(inference_params, tuple(cell.kernel_size), input_gradient, output_dtype)
    cell.onednn_params = Tensor(np.array(params, np.int32))
    cell.onednn_inference_params = Tensor(np.array(inference_params, np.int32))
    cell.onednn_blocked = bool(layout)
    cell.__class__ = OneDnnConv2d


def use_onednn_convolutions(net: nn.Cell, *, bf16: bool = False, image_gradient: bool = False) -> int:
    """Turn every supported Conv2d of `net` into OneDnnConv2d in place; returns how many.

    The class of each cell is changed rather than the cell replaced, so its Parameter objects,
    their names and every isinstance(cell, nn.Conv2d) check stay as they were. The network's first
    convolution reads the image (the stem of every network here): its input gradient is never
    needed and is not computed unless `image_gradient` (the layer finder compares it).
    `bf16`: the convolutions compute in bfloat16 (float32 in and out, float32 weight gradients)."""
    count = 0
    for _, cell in net.cells_and_names():
        if supported(cell):
            _swap_convolution(cell, bf16=bf16, input_gradient=image_gradient or count > 0)
            count += 1
    return count


def _one_value(*shapes):
    return [1]


def _float32(*dtypes):
    return mstype.float32


@functools.lru_cache(maxsize=None)
def all_finite_op() -> ops.Custom:
    """float32 [1]: 1 when every element of every (float32) input is finite, else 0; one
    multi-threaded pass over all of them (the training step's check of its gradients)."""
    return _aot("AllFinite", _one_value, _float32)


def _unscaled_shapes(factor, *gradients):
    return (*gradients, [1])


def _unscaled_dtypes(factor, *gradients):
    return (*gradients, mstype.float32)


@functools.lru_cache(maxsize=None)
def unscale_all_finite_op() -> ops.Custom:
    """(factor [1], *gradients) -> (*gradients x factor, [1]: 1 when every product is finite, else
    0): the loss scale divided out of the (float32) gradients and their check in one pass."""
    return _aot("UnscaleAllFinite", _unscaled_shapes, _unscaled_dtypes)


@functools.lru_cache(maxsize=None)
def momentum_step_op(count: int) -> ops.Custom:
    """(factor, lr, momentum, decays [count], *gradients, *weights, *moments) -> [1]: MindSpore's
    nn.Momentum step (its weight decay, then ApplyMomentum) over `count` float32 parameters with the
    gradients times `factor` (1 / loss scale), taken only when all of those are finite (1.0; else 0.0
    and nothing moves), in one kernel; the weights and moments are written in place, bit for bit what
    MindSpore's kernels write."""
    signature = (sig.make_sig("factor"), sig.make_sig("lr"), sig.make_sig("momentum"), sig.make_sig("decays"),
                 *(sig.make_sig(f"gradient{i}") for i in range(count)),
                 *(sig.make_sig(f"weight{i}", sig.sig_rw.RW_WRITE) for i in range(count)),
                 *(sig.make_sig(f"moment{i}", sig.sig_rw.RW_WRITE) for i in range(count)))
    written = type("MomentumStep", (_InputsWritten,), {"__mindspore_signature__": signature})
    return written(f"{LIBRARY}:MomentumStep", out_shape=_one_value, out_dtype=_float32, func_type="aot")


@functools.lru_cache(maxsize=None)
def fake_quant_op() -> ops.Custom:
    """(x, low, high, params) -> x fake-quantized: Golden Stick's simulated fake quantizer (the
    QuantParams record `params` says its levels, symmetry and channel axis; low and high hold its
    range, per channel or per tensor) in one float32 kernel, with its straight-through gradient as
    bprop; the bits of src/compression/qat.py's CpuFakeQuant from standard operators."""
    gradient = _aot("FakeQuantGrad", _of_input(0), _of_input(0))

    def bprop(x, low, high, params, out, dout):
        return gradient(x, low, high, params, dout), ops.zeros_like(low), ops.zeros_like(high), ops.zeros_like(params)

    return _aot("FakeQuant", _of_input(0), _of_input(0), bprop)


def _x_and_alpha(x, alpha, *others):
    return x, alpha


@functools.lru_cache(maxsize=None)
def learned_scale_quant_ops() -> Tuple[ops.Custom, ops.Custom]:
    """Golden Stick's LSQ fake quantizer in float32 kernels, as (forward, gradient): (x, alpha,
    quant_max, params) -> y and (x, alpha, quant_max, params, dy) -> (dx, dalpha), the LsqParams
    record `params` saying its lower end and channel axis; the caller's bprop runs the gradient
    (src/compression/qat.py's CpuLearnedScaleQuant, whose standard operators compute the same)."""
    return (_aot("LearnedScaleQuant", _of_input(0), _of_input(0)),
            _aot("LearnedScaleQuantGrad", _x_and_alpha, _x_and_alpha))


class _InputsWritten(ops.Custom):
    """A Custom op that writes some inputs in place (its class's signature marks them RW_WRITE)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_prim_attr("side_effect_mem", True)


# ---------------------------------------------------------------------------------------------
# Blocked layout between the layers of a ResNet.

# native/core.hpp's NormParams.activation: what the BatchNorm kernel applies after normalizing.
ACTIVATIONS = {"none": 0.0, "relu": 1.0, "add_relu": 2.0}


def _norm_forward_shape(x, gamma, beta, mean, variance, params, residual):
    # The workspace: a byte per element, at least what oneDNN needs (a bit per element; checked there).
    return x, gamma, gamma, [int(np.prod(x))]


def _norm_forward_dtypes(x, gamma, *others):
    return x, gamma, gamma, mstype.uint8


def _norm_backward_shape(x, dy, mean, variance, gamma, params, workspace, y, residual):
    return x, gamma, gamma, residual


_norm_backward_dtypes = _norm_backward_shape  # dx as x, the statistics' gradients as gamma, dresidual as residual


class _MovingStatisticsWritten(_InputsWritten):
    """A Custom op that writes its inputs 3 and 4 (the moving mean and variance) in place, and says
    so as MindSpore's BatchNorm does (RW_WRITE, side_effect_mem). Moving them in the graph took two
    Assigns per BatchNorm, whose ordering made compiling a ResNet18 step 1.2 s longer."""
    __mindspore_signature__ = (sig.make_sig("x"), sig.make_sig("gamma"), sig.make_sig("beta"),
                               sig.make_sig("mean", sig.sig_rw.RW_WRITE),
                               sig.make_sig("variance", sig.sig_rw.RW_WRITE), sig.make_sig("params"),
                               sig.make_sig("residual"))


@functools.lru_cache(maxsize=None)
def batch_norm_ops(global_stats: bool) -> ops.Custom:
    """Batch normalization of blocked tensors: (y, batch mean, biased batch variance, workspace)
    from (x, gamma, beta, moving mean, moving variance, params, residual). With `global_stats` it
    normalizes with the moving statistics (inference, frozen BatchNorm) and its statistics outputs
    are not written; without, it moves the moving statistics in place by the params' momentum.
    The params' activation (ACTIVATIONS) says what follows in the same kernel: 'relu', or
    'add_relu' (adding the residual first, as a ResNet block ends).

    One op for every activation, not one each: GRAPH mode compiled every op of this class in a
    graph as the first one it met (ops of two lengths failed to compile; of one length, the others'
    calls would run the first's). So every call passes a residual (a small stand-in without one),
    and the backward takes everything any activation needs."""
    backward = _aot("NormBackward", _norm_backward_shape, _norm_backward_dtypes)

    def bprop(x, gamma, beta, mean, variance, params, residual, out, dout):
        used_mean, used_variance = (mean, variance) if global_stats else (out[1], out[2])
        dx, dgamma, dbeta, dresidual = backward(x, dout[0], used_mean, used_variance, gamma, params, out[3], out[0],
                                                residual)
        return (dx, dgamma, dbeta, ops.zeros_like(mean), ops.zeros_like(variance), ops.zeros_like(params),
                dresidual)

    if global_stats:
        return _aot("NormForward", _norm_forward_shape, _norm_forward_dtypes, bprop)
    return _MovingStatisticsWritten(f"{LIBRARY}:NormForward", out_shape=_norm_forward_shape,
                                    out_dtype=_norm_forward_dtypes, func_type="aot", bprop=bprop)


def _forked_forward_shape(x, gamma, beta, mean, variance, params, residual):
    return (*_norm_forward_shape(x, gamma, beta, mean, variance, params, residual), x)


def _forked_forward_dtypes(x, gamma, *others):
    return (*_norm_forward_dtypes(x, gamma, *others), x)


def _summed_backward_shape(x, dy, mean, variance, gamma, params, workspace, y, dy_copy):
    return x, gamma, gamma, dy_copy  # dresidual: the residual's shape, which is the output's


_summed_backward_dtypes = _summed_backward_shape


class _ForkedMovingStatisticsWritten(_MovingStatisticsWritten):
    """NormForwardForked's op: _MovingStatisticsWritten's inputs, one more output. A class of its own:
    GRAPH mode compiles the ops of one class in a graph alike (batch_norm_ops says so)."""


@functools.lru_cache(maxsize=None)
def forked_batch_norm_op() -> ops.Custom:
    """The training forward of a float32 block's last normalization (add_relu, batch statistics)
    whose output two layers read, the next block's first convolution and its shortcut: it writes
    the output twice, (y, batch mean, batch variance, workspace, copy of y), and its backward sums
    the two outputs' gradients in its masking pass, where MindSpore would sum the gradients of one
    tensor read twice with AddN, a pass of its own (native/core.hpp's NORM_FORWARD_FORKED_SLOTS)."""
    backward = _aot("NormBackwardSummed", _summed_backward_shape, _summed_backward_dtypes)

    def bprop(x, gamma, beta, mean, variance, params, residual, out, dout):
        dx, dgamma, dbeta, dresidual = backward(x, dout[0], out[1], out[2], gamma, params, out[3], out[0], dout[4])
        return (dx, dgamma, dbeta, ops.zeros_like(mean), ops.zeros_like(variance), ops.zeros_like(params),
                dresidual)

    return _ForkedMovingStatisticsWritten(f"{LIBRARY}:NormForwardForked", out_shape=_forked_forward_shape,
                                          out_dtype=_forked_forward_dtypes, func_type="aot", bprop=bprop)


class OneDnnBatchNorm2d(nn.BatchNorm2d):
    """A BatchNorm2d on blocked tensors, with what follows it in its block computed in the same
    kernel as its params say ('relu', or 'add_relu' for construct(x, residual); see
    _hand_activations_to_norms). The moving statistics move as MindSpore's BatchNorm moves them, in
    the kernel: weight `momentum` (this cell's 1 - its constructor's) on the batch's mean and
    unbiased variance."""

    def construct(self, x, residual=None):
        # Without a residual a small tensor of its type stands in for it: one signature for every
        # call (batch_norm_ops says why).
        extra = self.onednn_stand_in if residual is None else residual
        use_batch = self.training if self.use_batch_statistics is None else self.use_batch_statistics
        if use_batch and self.onednn_forks:  # (y, its copy) for the next block: see fork_block_outputs
            out = self.onednn_forked(x, self.gamma, self.beta, self.moving_mean, self.moving_variance,
                                     self.onednn_batch_params, extra)
            return out[0], out[4]
        if use_batch:
            return self.onednn_batch(x, self.gamma, self.beta, self.moving_mean, self.moving_variance,
                                     self.onednn_batch_params, extra)[0]
        return self.onednn_global(x, self.gamma, self.beta, self.moving_mean, self.moving_variance,
                                  self.onednn_global_params, extra)[0]


def _swap_batch_norm(cell: nn.BatchNorm2d, activation: str = "none", dtype: mstype.Type = mstype.float32) -> None:
    cell.onednn_batch, cell.onednn_global = batch_norm_ops(False), batch_norm_ops(True)
    cell.onednn_stand_in = Tensor(np.zeros(4, np.float32), dtype)
    code = ACTIVATIONS[activation]  # momentum 0: the statistics stay
    batch = record("NormParams", epsilon=cell.eps, global_stats=0.0, momentum=cell.momentum, activation=code)
    given = record("NormParams", epsilon=cell.eps, global_stats=1.0, momentum=0.0, activation=code)
    cell.onednn_batch_params = Tensor(np.array(batch, np.float32))
    cell.onednn_global_params = Tensor(np.array(given, np.float32))
    cell.onednn_forks = False
    cell.__class__ = OneDnnBatchNorm2d


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
