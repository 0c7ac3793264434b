"""The training step's own ops: whether every gradient is finite (after unscaling), and the
momentum optimizer's update of every weight in one op."""
import functools

from mindspore import dtype as mstype
from mindspore import ops
from mindspore.ops import signature as sig

from src.cpu_layers.custom_ops import (
    _aot,
    _InputsWritten,
)
from src.cpu_layers.library import LIBRARY


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
