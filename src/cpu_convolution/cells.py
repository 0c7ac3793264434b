"""nn.Conv2d computed by this package's oneDNN kernels on CPU, with MindSpore's own Parameters.

`use_onednn_convolutions(net)` turns a network's Conv2d cells into OneDnnConv2d in place: same
weights, same names, same checkpoints; only `construct` differs. Export builds its own network
without them, so MINDIR and ONNX files hold standard convolutions."""
import functools
from typing import Tuple

import numpy as np
from mindspore import Tensor, nn, ops
from mindspore import dtype as mstype

from src.cpu_convolution.library import LIBRARY

PARAM_COUNT = 10  # onednn_conv.cpp's ConvParams


def _output_size(size: int, kernel: int, stride: int, pad: int, dilation: int) -> int:
    return (size + pad - dilation * (kernel - 1) - 1) // stride + 1


def _first_dtype(*dtypes):
    return dtypes[0]


def _shape_of_input(index: int):
    def shape(*shapes):
        return shapes[index]
    return shape


@functools.lru_cache(maxsize=None)
def convolution_ops(params: Tuple[int, ...], kernel: Tuple[int, int], input_gradient: bool):
    """The forward Custom op for one convolution's parameters, with its backward ops as bprop.
    `input_gradient` False: the input's gradient is zeros (the stem, whose input is the image)."""
    stride_h, stride_w, top, bottom, left, right, dilation_h, dilation_w = params[:8]

    def forward_shape(x, w, p):
        if top < 0:  # 'same'
            return [x[0], w[0], -(-x[2] // stride_h), -(-x[3] // stride_w)]
        return [x[0], w[0], _output_size(x[2], kernel[0], stride_h, top + bottom, dilation_h),
                _output_size(x[3], kernel[1], stride_w, left + right, dilation_w)]

    backward_data = ops.Custom(f"{LIBRARY}:ConvBackwardData", out_shape=_shape_of_input(3),
                               out_dtype=_first_dtype, func_type="aot")
    backward_weights = ops.Custom(f"{LIBRARY}:ConvBackwardWeights", out_shape=_shape_of_input(3),
                                  out_dtype=_first_dtype, func_type="aot")

    def bprop(x, w, p, out, dout):
        dx = backward_data(dout, w, p, x) if input_gradient else ops.zeros_like(x)
        return dx, backward_weights(x, dout, p, w), ops.zeros_like(p)

    return ops.Custom(f"{LIBRARY}:ConvForward", out_shape=forward_shape, out_dtype=_first_dtype,
                      func_type="aot", bprop=bprop)


def convolution_params(conv: nn.Conv2d, bf16: bool = False) -> Tuple[int, ...]:
    """stride, padding (top, bottom, left, right), dilation, groups and the bf16 flag of `conv`."""
    padding = conv.padding if conv.pad_mode == "pad" else 0
    if conv.pad_mode == "same":  # the kernels work the padding out from the input's size
        padding = -1
    top, bottom, left, right = (padding,) * 4 if isinstance(padding, int) else tuple(padding)
    stride, dilation = conv.stride[-2:], conv.dilation[-2:]
    return (stride[0], stride[1], top, bottom, left, right, dilation[0], dilation[1], conv.group, int(bf16))


def supported(cell: nn.Cell) -> bool:
    """nn.Conv2d itself (not a subclass such as THOR's) on NCHW tensors."""
    return type(cell) is nn.Conv2d and cell.data_format == "NCHW"


class OneDnnConv2d(nn.Conv2d):
    """A Conv2d whose three kernels are this package's (see `use_onednn_convolutions`). Inputs of
    another float type (amp) are computed in float32 and returned in their own type."""

    def construct(self, x):
        dtype = x.dtype
        y = self.onednn(ops.cast(x, mstype.float32), ops.cast(self.weight, mstype.float32), self.onednn_params)
        y = ops.cast(y, dtype)
        if self.has_bias:
            y = self.bias_add(y, self.bias)
        return y


def use_onednn_convolutions(net: nn.Cell, *, bf16: bool = False, image_gradient: bool = False) -> int:
    """Turn every supported Conv2d of `net` into OneDnnConv2d in place; returns how many.

    The class of each cell is changed rather than the cell replaced, so its Parameter objects,
    their names and every isinstance(cell, nn.Conv2d) check stay as they were. The network's first
    convolution reads the image (the stem of every network here): its input gradient is never
    needed and is not computed unless `image_gradient` (the layer finder compares it).
    `bf16`: the convolutions compute in bfloat16 (float32 in and out, float32 weight gradients)."""
    count = 0
    for _, cell in net.cells_and_names():
        if not supported(cell):
            continue
        params = convolution_params(cell, bf16)
        cell.onednn = convolution_ops(params, tuple(cell.kernel_size), input_gradient=image_gradient or count > 0)
        cell.onednn_params = Tensor(np.array(params, np.int32))
        cell.__class__ = OneDnnConv2d
        count += 1
    return count
