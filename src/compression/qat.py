"""Golden Stick's quantization-aware training on this repository's networks: simulated quantization
(SimQAT, compression qat) and learned step size quantization (LSQ, compression lsq).

Golden Stick 1.3.0's `SimulatedQuantizationAwareTraining.apply` finds the cells to quantize through
MindSpore's rewrite, which on MindSpore 2.10 does not read this repository's ResNets: resnet10
came back unchanged, without a single quantizer (a subclass with one flat construct failed to
parse instead), and its source was written into ./rewritten_network/ in the current directory.
So the cells are wrapped here, in place, with the very quantization cells apply inserts: the
algorithm's own layer policies (its default config: int8, weights per channel, activations per
tensor, BatchNorm unfused) around every nn.Conv2d and nn.Dense. Its fake-quantizer kernels exist on
GPU and Ascend only; on CPU their two steps (range update, nudged rounding) are computed here
(CpuMinMaxUpdate, CpuFakeQuant: the rounding in src/cpu_layers's kernel where the library is
built, else from standard operators, the same bits) in the same quantizer cells, so parameters,
checkpoints and Golden Stick's `convert` are the same on every device.

LSQ is wrapped the same way with its own policies (int8, symmetric, narrow range; weights per
channel); its weights' step sizes start where its `apply` starts them, from their KL threshold
(`compute_quant_param`), its activations' at 6 until a training run starts them from its first
batch (src/compression/lsq.py: 6 left them clipped). Its kernels
(FakeLearnedScaleQuantPerLayer/PerChannel) are GPU and Ascend only too (no CPU kernel in MindSpore
2.10); CpuLearnedScaleQuant computes them on CPU, forward and gradient as the GPU kernel does (in
src/cpu_layers's kernel too where the library is built).
"""
import copy
import importlib
import importlib.util
import os
import sys
from typing import Iterator, Optional, Tuple

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from src.cpu_layers import fake_quant_op, learned_scale_quant_ops, record, unavailable_reason
from src.errors import UserInputError, require_module

from . import INSTALL_HINT, LSQ, QAT

QUANTIZED_CELLS = (nn.Conv2d, nn.Dense)
FAKE_QUANTIZERS = "mindspore_gs.quantization.simulated_quantization.simulated_fake_quantizers"
# Each quantizing compression's algorithm in Golden Stick: its package, its class.
ALGORITHMS = {QAT: ("mindspore_gs.quantization.simulated_quantization", "SimulatedQuantizationAwareTraining"),
              LSQ: ("mindspore_gs.quantization.learned_step_size_quantization",
                    "LearnedStepSizeQuantizationAwareTraining")}
LSQ_PER_CHANNEL = "LearnedStepSizeFakeQuantizePerChannel"


def golden_stick(needed_for: str = f"compression {QAT}"):
    """mindspore_gs, imported on first use (2-12 s), or a one-line error saying how to install it
    and what needs it."""
    if "mindspore_gs" not in sys.modules:
        _skip_version_countdown()
    return require_module("mindspore_gs", needed_for=needed_for, install_hint=INSTALL_HINT)


def _algorithm(compression: str):
    """Golden Stick's algorithm of `compression` (qat or lsq), in its default config."""
    golden_stick(f"compression {compression}")
    package, name = ALGORITHMS[compression]
    return getattr(importlib.import_module(package), name)()


def _skip_version_countdown() -> None:
    """Golden Stick 1.3.0 checks for MindSpore 2.7 at import and, finding 2.10, logs three warnings
    and sleeps 2 s. requirements.txt pins the pair this repository tests, so the check is marked done."""
    spec = importlib.util.find_spec("mindspore_gs")
    if spec is None or not spec.submodule_search_locations:
        return
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    if not os.path.isfile(path):
        return
    version_spec = importlib.util.spec_from_file_location("mindspore_gs.version", path)
    if version_spec is None or version_spec.loader is None:
        return
    version = importlib.util.module_from_spec(version_spec)
    version_spec.loader.exec_module(version)
    version.__checked__ = True
    sys.modules["mindspore_gs.version"] = version


class CpuMinMaxUpdate(nn.Cell):
    """MinMaxUpdatePerLayer/PerChannel from standard operators: the range of this batch (per channel
    along `channel_axis`, or per tensor with None), widened to hold 0, optionally an EMA."""

    def __init__(self, channel_axis=None, ema: bool = False, ema_decay: float = 0.999):
        super().__init__()
        self.channel_axis = channel_axis
        self.ema, self.ema_decay = ema, ema_decay

    def construct(self, x, old_min, old_max):
        if self.channel_axis is None:
            low, high = ops.reshape(ops.reduce_min(x), (1,)), ops.reshape(ops.reduce_max(x), (1,))
        else:
            rows = ops.reshape(ops.moveaxis(x, self.channel_axis, 0), (x.shape[self.channel_axis], -1))
            low, high = ops.reduce_min(rows, 1), ops.reduce_max(rows, 1)
        if self.ema:
            low = self.ema_decay * old_min + (1 - self.ema_decay) * low
            high = self.ema_decay * old_max + (1 - self.ema_decay) * high
        return ops.minimum(low, 0.0), ops.maximum(high, 0.0)


class CpuFakeQuant(nn.Cell):
    """FakeQuantPerLayer/PerChannel from standard operators: x clipped to the nudged range (so 0 is
    exact) and rounded onto its 2^num_bits levels; the gradient passes where x is inside the range,
    its ends included (straight-through), as the kernels' gradients do. With `kernel` float32 inputs
    take src/cpu_layers's FakeQuant instead: the same bits in one op each way, which compiles in
    a fraction of the time (resnet10's QAT training graph: 3.4 s against 8.7 s)."""

    def __init__(self, num_bits: int = 8, symmetric: bool = False, narrow_range: bool = False, channel_axis=None,
                 kernel: bool = False):
        super().__init__()
        self.quant_min = 1.0 if narrow_range else 0.0
        self.quant_max = float(2 ** num_bits - 1)
        self.symmetric = symmetric
        self.channel_axis = channel_axis
        self.kernel = fake_quant_op() if kernel else None
        self.params = ms.Tensor(np.array(record("QuantParams", quant_min=self.quant_min, quant_max=self.quant_max,
                                                symmetric=float(symmetric),
                                                channel_axis=-1.0 if channel_axis is None else float(channel_axis)),
                                         np.float32))

    def construct(self, x, low, high):
        if self.kernel is not None and x.dtype == ms.float32:
            return self.kernel(x, low, high, self.params)
        return self.standard(x, low, high)

    def standard(self, x, low, high):
        """The fake quantizer from MindSpore's standard operators (any float type, any device)."""
        if self.symmetric:
            high = ops.maximum(ops.abs(low), ops.abs(high))
            low = -high
        scale = ops.maximum((high - low) / (self.quant_max - self.quant_min), 1e-12)
        zero_point = ops.clip_by_value(ops.round(self.quant_min - low / scale), self.quant_min, self.quant_max)
        nudged_min = (self.quant_min - zero_point) * scale
        nudged_max = (self.quant_max - zero_point) * scale
        if self.channel_axis is not None:  # per channel: the ranges broadcast along the channel axis
            shape = [1] * x.ndim
            shape[self.channel_axis] = -1
            scale, nudged_min, nudged_max = (ops.reshape(t, tuple(shape)) for t in (scale, nudged_min, nudged_max))
        # Clipped with ReLUs: MindSpore's CPU Maximum/Minimum against a broadcast range took 10x as long
        # (25 ms against 2.5 ms for a 16x64x16x16 tensor), most of a QAT step.
        clipped = nudged_min + ops.relu(x - nudged_min) - ops.relu(x - nudged_max)
        rounded = ops.round((clipped - nudged_min) / scale) * scale + nudged_min
        inside = ops.cast(ops.logical_and(x >= nudged_min, x <= nudged_max), x.dtype)
        passed = x * ops.stop_gradient(inside)  # the gradient: 1 inside the range (its ends included), else 0
        return passed + ops.stop_gradient(rounded - passed)


class CpuLearnedScaleQuant(nn.Cell):
    """FakeLearnedScaleQuantPerLayer/PerChannel (quant_delay 0, the only delay Golden Stick's LSQ
    allows) from standard operators, as the GPU kernel computes it: r = x / alpha clipped to [-1, 1]
    ([0, 1] with neg_trunc), rounded half up onto quant_max levels, times alpha (alpha = step size x
    quant_max). Its gradient is the kernel's, so it is written out (bprop): dx passes where r is
    inside the range, its ends included; dalpha sums dout x (q - r) inside, dout above the range and
    -dout below it (also with neg_trunc, where the output below is 0 and the exact derivative 0:
    the kernel's choice, kept). With `kernel` float32 inputs take src/cpu_layers's
    LearnedScaleQuant instead, one op each way: the forward's bits and dx's, dalpha to float32
    rounding (its sums are added in another order)."""

    def __init__(self, neg_trunc: bool = False, channel_axis=None, kernel: bool = False):
        super().__init__()
        self.lower = 0.0 if neg_trunc else -1.0
        self.channel_axis = channel_axis
        self.kernel, self.kernel_gradient = learned_scale_quant_ops() if kernel else (None, None)
        self.params = ms.Tensor(np.array(record("LsqParams", lower=self.lower, channel_axis=-1.0 if channel_axis is None
                                                else float(channel_axis)), np.float32))

    def _alpha(self, alpha, x):
        """alpha, broadcast along x's channel axis when per channel."""
        if self.channel_axis is None:
            return alpha
        shape = [1] * x.ndim
        shape[self.channel_axis] = -1
        return ops.reshape(alpha, tuple(shape))

    def _quantized(self, ratio, quant_max):
        # Scalar bounds (unlike CpuFakeQuant's per-channel ranges), which Maximum/Minimum take fast and exactly.
        return ops.floor(ops.minimum(ops.maximum(ratio, self.lower), 1.0) * quant_max + 0.5) / quant_max

    def construct(self, x, alpha, quant_max):
        if self.kernel is not None and x.dtype == ms.float32:
            return self.kernel(x, alpha, quant_max, self.params)
        alpha = self._alpha(alpha, x)
        return self._quantized(x / alpha, quant_max) * alpha

    def bprop(self, x, alpha, quant_max, out, dout):
        """The GPU kernel's FakeLearnedScaleQuantPerLayerGrad/PerChannelGrad."""
        if self.kernel_gradient is not None and x.dtype == ms.float32:
            dx, grad_alpha = self.kernel_gradient(x, alpha, quant_max, self.params, dout)
            return dx, grad_alpha, ops.zeros_like(quant_max)
        ratio = x / self._alpha(alpha, x)
        above = ops.cast(ratio > 1.0, x.dtype)
        below = ops.cast(ratio < self.lower, x.dtype)
        inside = 1.0 - above - below
        each = dout * (above - below + inside * (self._quantized(ratio, quant_max) - ratio))
        if self.channel_axis is None:
            grad_alpha = ops.reshape(ops.reduce_sum(each), alpha.shape)
        else:
            axes = tuple(axis for axis in range(x.ndim) if axis != self.channel_axis)
            grad_alpha = ops.reduce_sum(each, axes)
        return dout * inside, grad_alpha, ops.zeros_like(quant_max)


def cpu_fake_quantizers() -> str:
    """How the fake quantizers (SimQAT's, LSQ's) compute on CPU, in a phrase for the run's log."""
    reason = unavailable_reason()
    if reason is None:
        return "its fake quantizers run in src/cpu_layers's kernel"
    return (f"its fake quantizers run as MindSpore's standard operators, slower to compile and run (this "
            f"repository's CPU library: {reason})")


def _run_on_cpu(quantizer, kernel: bool) -> None:
    """Give one of Golden Stick's simulated fake quantizers the CPU cells above (same parameters)."""
    axis = quantizer._channel_axis if quantizer.is_per_channel() else None  # noqa: SLF001
    quantizer._min_max_update_func = CpuMinMaxUpdate(axis, quantizer._ema, quantizer._ema_decay)  # noqa: SLF001
    fake_quant = CpuFakeQuant(quantizer.num_bits(), quantizer.symmetric(), quantizer.narrow_range(), axis, kernel)
    quantizer._fake_quant_train = fake_quant  # noqa: SLF001
    quantizer._fake_quant_infer = fake_quant  # noqa: SLF001


def _lsq_quantizers(net: nn.Cell) -> Iterator[Tuple[nn.Cell, Optional[int]]]:
    """Golden Stick's LSQ fake quantizers in `net` (the quantizers that hold quant_max), each with its
    channel axis, None per tensor: is_per_channel() is False for both kinds (Golden Stick 1.3.0), so
    the class tells."""
    for _, cell in net.cells_and_names():
        if hasattr(cell, "quant_max") and hasattr(cell, "_float_max"):
            yield cell, cell._channel_axis if type(cell).__name__ == LSQ_PER_CHANNEL else None  # noqa: SLF001


def _run_lsq_on_cpu(quantizer, channel_axis: Optional[int], kernel: bool) -> None:
    """Give one of Golden Stick's LSQ fake quantizers CpuLearnedScaleQuant (same parameters)."""
    fake_quant = CpuLearnedScaleQuant(quantizer._neg_trunc, channel_axis, kernel)  # noqa: SLF001
    quantizer.fake_quant_train = fake_quant
    quantizer.fake_quant_infer = fake_quant


def apply_qat(net: nn.Cell, compression: str = QAT) -> nn.Cell:
    """`net` with every nn.Conv2d and nn.Dense wrapped in Golden Stick's quantization cells of
    `compression` (qat: SimQAT, lsq: LSQ), in place; parameter names keep their place:
    `layer1.0.conv1.weight`, `layer1.0.conv1._input_quantizer._float_min`. On CPU the fake quantizers
    compute with the cells above."""
    policy = _algorithm(compression)._qat_policy  # noqa: SLF001  (apply's policies; its rewrite cannot read ResNet)
    policy.build()
    wrapped = _wrap(net, "", policy.get_layer_policy_map())
    if not wrapped:
        raise UserInputError(f"compression {compression} found no nn.Conv2d or nn.Dense to quantize (this "
                             f"repository's oneDNN layers replace them); pass --cpu_convolution mindspore")
    if compression == LSQ:
        _start_step_sizes(net, wrapped)
    if ms.get_context("device_target") != "CPU":
        return net
    kernel = unavailable_reason() is None
    if compression == LSQ:
        for quantizer, axis in _lsq_quantizers(net):
            _run_lsq_on_cpu(quantizer, axis, kernel)
        return net
    simulated = importlib.import_module(FAKE_QUANTIZERS)
    for _, cell in net.cells_and_names():
        if isinstance(cell, simulated.SimulatedFakeQuantizerPerLayer):
            _run_on_cpu(cell, kernel)
    return net


def _start_step_sizes(net: nn.Cell, wrapped: list) -> None:
    """What LSQ's apply does after wrapping (`_reset_weights_quantization_params`, which looks at the
    top cells only, so it is done here on the wrapped ones): each weight quantizer's step from the
    weights' KL threshold. Its quant_max (the level count) and _float_min (which LSQ never reads
    while training) stay constants: Golden Stick's gradient for quant_max is 0, and out of the
    optimizer they carry no momentum into the checkpoints."""
    for cell in wrapped:
        cell.weight_quantizer().compute_quant_param(cell.handler().weight)
    for quantizer, _ in _lsq_quantizers(net):
        quantizer.quant_max.requires_grad = False
        quantizer._float_min.requires_grad = False  # noqa: SLF001


def _wrap(cell: nn.Cell, prefix: str, policies: dict) -> list:
    """Wrap the quantizable cells below `cell` (named from `prefix`); returns the wrapped cells."""
    wrapped = []
    for name, child in list(cell.name_cells().items()):
        path = prefix + name
        if type(child) in QUANTIZED_CELLS:  # exact types, as Golden Stick's policy map is keyed
            quantized = copy.deepcopy(policies[type(child)]).wrap_cell(child)
            if isinstance(cell, nn.SequentialCell):
                cell[int(name)] = quantized
            else:
                setattr(cell, name, quantized)
            # After setattr, which prefixes the names with the attribute alone: the whole path.
            quantized.update_parameters_name(path + ".")
            wrapped.append(quantized)
        else:
            wrapped += _wrap(child, path + ".", policies)
    return wrapped


def convert_for_export(net: nn.Cell, compression: str = QAT) -> nn.Cell:
    """The quantization-aware network as an inference network: Golden Stick's convert replaces each
    fake quantizer by its range (FakeQuantParam), which inference back-ends read to run int8."""
    if not any(isinstance(cell, nn.Cell) and hasattr(cell, "_weight_quantizer") for _, cell in net.cells_and_names()):
        raise UserInputError(f"this network holds no quantization cells; export it without --compression "
                             f"{compression}")
    if compression == LSQ:
        _ranges_from_step_sizes(net)
    return _algorithm(compression).convert(net)


def _ranges_from_step_sizes(net: nn.Cell) -> None:
    """LSQ learns alpha (step size x quant_max) in _float_max alone and clips at +-|alpha| (the weights'
    alpha starts negative: compute_quant_param swaps min and max), while convert reads the range from
    _float_min and _float_max: both are set to -|alpha|, |alpha|, so the exported scale is the learned
    step. And its per-channel quantizer says it is per tensor (Golden Stick 1.3.0), so convert would
    write its per-channel scales marked per tensor, with no channel axis: it is told its axis."""
    for quantizer, axis in _lsq_quantizers(net):
        alpha = np.abs(quantizer._float_max.asnumpy())  # noqa: SLF001
        quantizer._float_min.set_data(ms.Tensor(-alpha))  # noqa: SLF001
        quantizer._float_max.set_data(ms.Tensor(alpha))  # noqa: SLF001
        if axis is not None:
            quantizer.is_per_channel = lambda: True
            quantizer.channel_axis = lambda axis=axis: axis
