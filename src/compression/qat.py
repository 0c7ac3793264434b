"""Golden Stick's simulated quantization-aware training (SimQAT) on this repository's networks.

Golden Stick 1.3.0's `SimulatedQuantizationAwareTraining.apply` finds the cells to quantize through
MindSpore's rewrite, which on MindSpore 2.10 does not read this repository's ResNets: resnet10
came back unchanged, without a single quantizer (a subclass with one flat construct failed to
parse instead), and its source was written into ./rewritten_network/ in the current directory.
So the cells are wrapped here, in place, with the very quantization cells apply inserts: the
algorithm's own layer policies (its default config: int8, weights per channel, activations per
tensor, BatchNorm unfused) around every nn.Conv2d and nn.Dense. Its fake-quantizer kernels exist on
GPU and Ascend only; on CPU their two steps (range update, nudged rounding) are computed here from
standard operators (CpuMinMaxUpdate, CpuFakeQuant) in the same quantizer cells, so parameters,
checkpoints and Golden Stick's `convert` are the same on every device.
"""
import copy
import importlib
import importlib.util
import os
import sys

import mindspore as ms
from mindspore import nn, ops

from src.errors import UserInputError, require_module

from . import INSTALL_HINT

QUANTIZED_CELLS = (nn.Conv2d, nn.Dense)
FAKE_QUANTIZERS = "mindspore_gs.quantization.simulated_quantization.simulated_fake_quantizers"


def golden_stick():
    """mindspore_gs, imported on first use (2-12 s), or a one-line error saying how to install it."""
    if "mindspore_gs" not in sys.modules:
        _skip_version_countdown()
    return require_module("mindspore_gs", needed_for="compression qat", install_hint=INSTALL_HINT)


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
    its ends included (straight-through), as the kernels' gradients do."""

    def __init__(self, num_bits: int = 8, symmetric: bool = False, narrow_range: bool = False, channel_axis=None):
        super().__init__()
        self.quant_min = 1.0 if narrow_range else 0.0
        self.quant_max = float(2 ** num_bits - 1)
        self.symmetric = symmetric
        self.channel_axis = channel_axis

    def construct(self, x, low, high):
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


def _run_on_cpu(quantizer) -> None:
    """Give one of Golden Stick's simulated fake quantizers the CPU cells above (same parameters)."""
    axis = quantizer._channel_axis if quantizer.is_per_channel() else None  # noqa: SLF001
    quantizer._min_max_update_func = CpuMinMaxUpdate(axis, quantizer._ema, quantizer._ema_decay)  # noqa: SLF001
    fake_quant = CpuFakeQuant(quantizer.num_bits(), quantizer.symmetric(), quantizer.narrow_range(), axis)
    quantizer._fake_quant_train = fake_quant  # noqa: SLF001
    quantizer._fake_quant_infer = fake_quant  # noqa: SLF001


def apply_qat(net: nn.Cell) -> nn.Cell:
    """`net` with every nn.Conv2d and nn.Dense wrapped in Golden Stick's SimQAT cells (in place;
    parameter names keep their place: `layer1.0.conv1.weight`, `layer1.0.conv1._input_quantizer._float_min`).
    On CPU the fake quantizers compute with CpuMinMaxUpdate and CpuFakeQuant."""
    gs = golden_stick()
    algorithm = gs.SimulatedQuantizationAwareTraining()
    policy = algorithm._qat_policy  # noqa: SLF001  (the policies apply would use; apply's rewrite cannot read ResNet)
    policy.build()
    policies = policy.get_layer_policy_map()
    if not _wrap(net, "", policies):
        raise UserInputError("compression qat found no nn.Conv2d or nn.Dense to quantize (this repository's oneDNN "
                             "layers replace them); pass --cpu_convolution mindspore")
    if ms.get_context("device_target") == "CPU":
        simulated = importlib.import_module(FAKE_QUANTIZERS)
        for _, cell in net.cells_and_names():
            if isinstance(cell, simulated.SimulatedFakeQuantizerPerLayer):
                _run_on_cpu(cell)
    return net


def _wrap(cell: nn.Cell, prefix: str, policies: dict) -> int:
    """Wrap the quantizable cells below `cell` (named from `prefix`); returns how many."""
    wrapped = 0
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
            wrapped += 1
        else:
            wrapped += _wrap(child, path + ".", policies)
    return wrapped


def convert_for_export(net: nn.Cell) -> nn.Cell:
    """The QAT network as an inference network: Golden Stick's convert replaces each fake quantizer by
    its range (FakeQuantParam), which inference back-ends read to run int8."""
    if not any(isinstance(cell, nn.Cell) and hasattr(cell, "_weight_quantizer") for _, cell in net.cells_and_names()):
        raise UserInputError("this network holds no quantization cells; export it without --compression qat")
    return golden_stick().SimulatedQuantizationAwareTraining().convert(net)
