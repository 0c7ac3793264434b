"""The momentum optimizer's update of every weight in one op (optimizer.cpp)."""
import functools

from mindspore import ops
from mindspore.ops import signature as sig

from src.cpu_layers.custom_ops import InputsWritten, float32_type, one_value
from src.cpu_layers.library import LIBRARY


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
    written = type("MomentumStep", (InputsWritten,), {"__mindspore_signature__": signature})
    return written(f"{LIBRARY}:MomentumStep", out_shape=one_value, out_dtype=float32_type, func_type="aot")
