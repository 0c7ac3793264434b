"""Fake quantization ops for quantization-aware training: min-max fake quant and LSQ's learned step
size, with their gradients."""
import functools
from typing import Tuple

from mindspore import ops

from src.cpu_layers.custom_ops import (
    aot_op,
    of_input,
)


@functools.lru_cache(maxsize=None)
def fake_quant_op() -> ops.Custom:
    """(x, low, high, params) -> x fake-quantized: Golden Stick's simulated fake quantizer (the
    QuantParams record `params` says its levels, symmetry and channel axis; low and high hold its
    range, per channel or per tensor) in one float32 kernel, with its straight-through gradient as
    bprop; the bits of src/compression/qat.py's CpuFakeQuant from standard operators."""
    gradient = aot_op("FakeQuantGrad", of_input(0), of_input(0))

    def bprop(x, low, high, params, out, dout):
        return gradient(x, low, high, params, dout), ops.zeros_like(low), ops.zeros_like(high), ops.zeros_like(params)

    return aot_op("FakeQuant", of_input(0), of_input(0), bprop)


def _x_and_alpha(x, alpha, *others):
    return x, alpha


@functools.lru_cache(maxsize=None)
def learned_scale_quant_ops() -> Tuple[ops.Custom, ops.Custom]:
    """Golden Stick's LSQ fake quantizer in float32 kernels, as (forward, gradient): (x, alpha,
    quant_max, params) -> y and (x, alpha, quant_max, params, dy) -> (dx, dalpha), the LsqParams
    record `params` saying its lower end and channel axis; the caller's bprop runs the gradient
    (src/compression/qat.py's CpuLearnedScaleQuant, whose standard operators compute the same)."""
    return (aot_op("LearnedScaleQuant", of_input(0), of_input(0)),
            aot_op("LearnedScaleQuantGrad", _x_and_alpha, _x_and_alpha))
