"""The library's kernels as MindSpore Custom ops: their parameter records, the op of a kernel, the
shapes and types of its outputs, and ops that write some inputs in place. The cells of each op
family (convolution, normalization, pooling, elementwise, quantization, optimizer) and the blocked
network build on these."""
from typing import Tuple

from mindspore import dtype as mstype
from mindspore import ops

from src.cpu_layers.library import LIBRARY, RECORDS

INPUT_BLOCKED, OUTPUT_BLOCKED = 1, 2  # native/core.hpp's ConvParams.layout bits


def record(name: str, **fields) -> Tuple:
    """The parameter record `name` (library.RECORDS) from its fields by name, in the library's order."""
    order = RECORDS[name]
    if set(fields) != set(order):
        raise ValueError(f"{name} takes the fields {', '.join(order)}; got {', '.join(sorted(fields))}")
    return tuple(fields[field] for field in order)


def aot_op(name: str, out_shape, out_dtype, bprop=None, shape_key: Tuple = ()) -> ops.Custom:
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


def of_input(index: int):
    """out_shape or out_dtype: the shape or type of input `index`."""
    def pick(*shapes_or_dtypes):
        return shapes_or_dtypes[index]
    return pick


def one_value(*shapes):
    """out_shape: one value (a flag)."""
    return [1]


def float32_type(*dtypes):
    """out_dtype: float32."""
    return mstype.float32


def output_size(size: int, kernel: int, stride: int, pad: int, dilation: int) -> int:
    """A convolution's or pool's output size along one axis (`pad`: both sides together)."""
    return (size + pad - dilation * (kernel - 1) - 1) // stride + 1


class InputsWritten(ops.Custom):
    """A Custom op that writes some inputs in place (its class's signature marks them RW_WRITE)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_prim_attr("side_effect_mem", True)
