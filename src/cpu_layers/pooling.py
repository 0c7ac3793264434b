"""Max pooling of blocked tensors (pooling.cpp): the op and the ResNet stem's pool cell."""
import functools

from mindspore import nn, ops

from src.cpu_layers.custom_ops import aot_op, of_input, output_size


@functools.lru_cache(maxsize=None)
def max_pool_ops(kernel: int, stride: int, pad: int) -> ops.Custom:
    """Max pooling of blocked tensors; padded positions never win a window."""
    def out_shape(x, params):
        return [x[0], x[1], output_size(x[2], kernel, stride, 2 * pad, 1),
                output_size(x[3], kernel, stride, 2 * pad, 1)]

    backward = aot_op("PoolBackward", of_input(0), of_input(0))

    def bprop(x, params, out, dout):
        return backward(x, dout, params), ops.zeros_like(params)

    return aot_op("PoolForward", out_shape, of_input(0), bprop, shape_key=(kernel, stride, pad))


class OneDnnMaxPool(nn.SequentialCell):
    """The ResNet stem's [Border(-1), MaxPool2d(3, 2)] as one max pool of padding 1 on blocked
    tensors: the same windows, and the border never wins one (the input is post-ReLU)."""

    def construct(self, x):
        return self.onednn(x, self.onednn_params)
