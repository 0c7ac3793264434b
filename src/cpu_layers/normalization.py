"""BatchNorm through the library on blocked tensors, with the ReLU or residual addition that follows
it in the same kernel, and its forked form (a block's output read by two layers)."""
import functools

import numpy as np
from mindspore import Tensor, nn, ops
from mindspore import dtype as mstype
from mindspore.ops import signature as sig

from src.cpu_layers.custom_ops import (
    InputsWritten,
    aot_op,
    record,
)
from src.cpu_layers.library import LIBRARY

# native/core.hpp's NormParams.activation: what the BatchNorm kernel applies after normalizing.
ACTIVATIONS = {"none": 0.0, "relu": 1.0, "add_relu": 2.0}


def _norm_forward_shape(x, gamma, beta, mean, variance, params, residual):
    # The workspace: a byte per element, at least what oneDNN needs (a bit per element; checked there).
    return x, gamma, gamma, [int(np.prod(x))]


def _norm_forward_dtypes(x, gamma, *others):
    return x, gamma, gamma, mstype.uint8


def _norm_backward_shape(x, dy, mean, variance, gamma, params, workspace, y, residual):
    return x, gamma, gamma, residual


_norm_backward_dtypes = _norm_backward_shape  # dx as x, the statistics' gradients as gamma, dresidual as residual


class _MovingStatisticsWritten(InputsWritten):
    """A Custom op that writes its inputs 3 and 4 (the moving mean and variance) in place, and says
    so as MindSpore's BatchNorm does (RW_WRITE, side_effect_mem). Moving them in the graph took two
    Assigns per BatchNorm, whose ordering made compiling a ResNet18 step 1.2 s longer."""
    __mindspore_signature__ = (sig.make_sig("x"), sig.make_sig("gamma"), sig.make_sig("beta"),
                               sig.make_sig("mean", sig.sig_rw.RW_WRITE),
                               sig.make_sig("variance", sig.sig_rw.RW_WRITE), sig.make_sig("params"),
                               sig.make_sig("residual"))


@functools.lru_cache(maxsize=None)
def batch_norm_ops(global_stats: bool) -> ops.Custom:
    """Batch normalization of blocked tensors: (y, batch mean, biased batch variance, workspace)
    from (x, gamma, beta, moving mean, moving variance, params, residual). With `global_stats` it
    normalizes with the moving statistics (inference, frozen BatchNorm) and its statistics outputs
    are not written; without, it moves the moving statistics in place by the params' momentum.
    The params' activation (ACTIVATIONS) says what follows in the same kernel: 'relu', or
    'add_relu' (adding the residual first, as a ResNet block ends).

    One op for every activation, not one each: GRAPH mode compiled every op of this class in a
    graph as the first one it met (ops of two lengths failed to compile; of one length, the others'
    calls would run the first's). So every call passes a residual (a small stand-in without one),
    and the backward takes everything any activation needs."""
    backward = aot_op("NormBackward", _norm_backward_shape, _norm_backward_dtypes)

    def bprop(x, gamma, beta, mean, variance, params, residual, out, dout):
        used_mean, used_variance = (mean, variance) if global_stats else (out[1], out[2])
        dx, dgamma, dbeta, dresidual = backward(x, dout[0], used_mean, used_variance, gamma, params, out[3], out[0],
                                                residual)
        return (dx, dgamma, dbeta, ops.zeros_like(mean), ops.zeros_like(variance), ops.zeros_like(params),
                dresidual)

    if global_stats:
        return aot_op("NormForward", _norm_forward_shape, _norm_forward_dtypes, bprop)
    return _MovingStatisticsWritten(f"{LIBRARY}:NormForward", out_shape=_norm_forward_shape,
                                    out_dtype=_norm_forward_dtypes, func_type="aot", bprop=bprop)


def _forked_forward_shape(x, gamma, beta, mean, variance, params, residual):
    return (*_norm_forward_shape(x, gamma, beta, mean, variance, params, residual), x)


def _forked_forward_dtypes(x, gamma, *others):
    return (*_norm_forward_dtypes(x, gamma, *others), x)


def _summed_backward_shape(x, dy, mean, variance, gamma, params, workspace, y, dy_copy):
    return x, gamma, gamma, dy_copy  # dresidual: the residual's shape, which is the output's


_summed_backward_dtypes = _summed_backward_shape


class _ForkedMovingStatisticsWritten(_MovingStatisticsWritten):
    """NormForwardForked's op: _MovingStatisticsWritten's inputs, one more output. A class of its own:
    GRAPH mode compiles the ops of one class in a graph alike (batch_norm_ops says so)."""


@functools.lru_cache(maxsize=None)
def forked_batch_norm_op() -> ops.Custom:
    """The training forward of a float32 block's last normalization (add_relu, batch statistics)
    whose output two layers read, the next block's first convolution and its shortcut: it writes
    the output twice, (y, batch mean, batch variance, workspace, copy of y), and its backward sums
    the two outputs' gradients in its masking pass, where MindSpore would sum the gradients of one
    tensor read twice with AddN, a pass of its own (native/core.hpp's NORM_FORWARD_FORKED_SLOTS)."""
    backward = aot_op("NormBackwardSummed", _summed_backward_shape, _summed_backward_dtypes)

    def bprop(x, gamma, beta, mean, variance, params, residual, out, dout):
        dx, dgamma, dbeta, dresidual = backward(x, dout[0], out[1], out[2], gamma, params, out[3], out[0], dout[4])
        return (dx, dgamma, dbeta, ops.zeros_like(mean), ops.zeros_like(variance), ops.zeros_like(params),
                dresidual)

    return _ForkedMovingStatisticsWritten(f"{LIBRARY}:NormForwardForked", out_shape=_forked_forward_shape,
                                          out_dtype=_forked_forward_dtypes, func_type="aot", bprop=bprop)


class OneDnnBatchNorm2d(nn.BatchNorm2d):
    """A BatchNorm2d on blocked tensors, with what follows it in its block computed in the same
    kernel as its params say ('relu', or 'add_relu' for construct(x, residual); see
    _hand_activations_to_norms). The moving statistics move as MindSpore's BatchNorm moves them, in
    the kernel: weight `momentum` (this cell's 1 - its constructor's) on the batch's mean and
    unbiased variance."""

    def construct(self, x, residual=None):
        # Without a residual a small tensor of its type stands in for it: one signature for every
        # call (batch_norm_ops says why).
        extra = self.onednn_stand_in if residual is None else residual
        use_batch = self.training if self.use_batch_statistics is None else self.use_batch_statistics
        if use_batch and self.onednn_forks:  # (y, its copy) for the next block: see fork_block_outputs
            out = self.onednn_forked(x, self.gamma, self.beta, self.moving_mean, self.moving_variance,
                                     self.onednn_batch_params, extra)
            return out[0], out[4]
        if use_batch:
            return self.onednn_batch(x, self.gamma, self.beta, self.moving_mean, self.moving_variance,
                                     self.onednn_batch_params, extra)[0]
        return self.onednn_global(x, self.gamma, self.beta, self.moving_mean, self.moving_variance,
                                  self.onednn_global_params, extra)[0]


def swap_batch_norm(cell: nn.BatchNorm2d, activation: str = "none", dtype: mstype.Type = mstype.float32) -> None:
    cell.onednn_batch, cell.onednn_global = batch_norm_ops(False), batch_norm_ops(True)
    cell.onednn_stand_in = Tensor(np.zeros(4, np.float32), dtype)
    code = ACTIVATIONS[activation]  # momentum 0: the statistics stay
    batch = record("NormParams", epsilon=cell.eps, global_stats=0.0, momentum=cell.momentum, activation=code)
    given = record("NormParams", epsilon=cell.eps, global_stats=1.0, momentum=0.0, activation=code)
    cell.onednn_batch_params = Tensor(np.array(batch, np.float32))
    cell.onednn_global_params = Tensor(np.array(given, np.float32))
    cell.onednn_forks = False
    cell.__class__ = OneDnnBatchNorm2d
