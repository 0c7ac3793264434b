"""Convolutions through the library: the ops of one convolution's forward and backwards, their
parameter records, and OneDnnConv2d, which an nn.Conv2d becomes in place (use_onednn_convolutions)."""
import functools
from typing import Tuple

import numpy as np
from mindspore import Tensor, nn, ops
from mindspore import dtype as mstype

from src.cpu_layers.custom_ops import (
    aot_op,
    of_input,
    output_size,
    record,
)
from src.cpu_layers.library import weight_matrix_elements


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
            y = [x[0], w[0], output_size(x[2], kernel[0], stride_h, top + bottom, dilation_h),
                 output_size(x[3], kernel[1], stride_w, left + right, dilation_w)]
        return y, [max(weight_matrix_elements(x, w, y, params), 1)]

    def forward_dtypes(x, w, p):
        return (getattr(mstype, output_dtype) if output_dtype else x), mstype.float32

    backward_data = aot_op("ConvBackwardData", of_input(3), of_input(3))
    backward_weights = aot_op("ConvBackwardWeights", of_input(3), of_input(3))

    def bprop(x, w, p, out, dout):
        dy = dout[0]
        dx = backward_data(dy, w, p, x, out[1]) if input_gradient else ops.zeros_like(x)
        return dx, backward_weights(x, dy, p, w), ops.zeros_like(p)

    forward = aot_op("ConvForward", forward_shape, forward_dtypes, bprop, shape_key=params + kernel)
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


def swap_convolution(cell: nn.Conv2d, *, bf16: bool, input_gradient: bool, layout: int = 0,
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
            swap_convolution(cell, bf16=bf16, input_gradient=image_gradient or count > 0)
            count += 1
    return count
