"""Element-wise ops (elementwise.cpp): the reorder from blocked tensors back to NCHW, the fork of
a tensor two layers read (its gradient: the sum of the two), and the training step's check that
every gradient is finite (after unscaling)."""
import functools

from mindspore import dtype as mstype
from mindspore import nn, ops

from src.cpu_layers.custom_ops import aot_op, float32_type, of_input, one_value


@functools.lru_cache(maxsize=None)
def to_plain_op(blocked_dtype: str) -> ops.Custom:
    """Blocked (of `blocked_dtype`, a mindspore.dtype name) -> NCHW float32; its gradient is the
    reorder back."""
    to_blocked = aot_op("ToBlocked", of_input(0), blocked_dtype)

    def bprop(x, out, dout):
        return (to_blocked(dout),)

    return aot_op("ToPlain", of_input(0), "float32", bprop)


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
    total = aot_op("Sum", of_input(0), of_input(0))

    def bprop(x, out, dout):
        return (total(dout[0], dout[1]),)

    return aot_op("Fork", _twice, _twice, bprop)


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


@functools.lru_cache(maxsize=None)
def all_finite_op() -> ops.Custom:
    """float32 [1]: 1 when every element of every (float32) input is finite, else 0; one
    multi-threaded pass over all of them (the training step's check of its gradients)."""
    return aot_op("AllFinite", one_value, float32_type)


def _unscaled_shapes(factor, *gradients):
    return (*gradients, [1])


def _unscaled_dtypes(factor, *gradients):
    return (*gradients, mstype.float32)


@functools.lru_cache(maxsize=None)
def unscale_all_finite_op() -> ops.Custom:
    """(factor [1], *gradients) -> (*gradients x factor, [1]: 1 when every product is finite, else
    0): the loss scale divided out of the (float32) gradients and their check in one pass."""
    return aot_op("UnscaleAllFinite", _unscaled_shapes, _unscaled_dtypes)
