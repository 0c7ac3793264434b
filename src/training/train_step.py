"""One training step as a single cell that `Model` runs: the input stage (the dataset's uint8
batch to normalized float images, erasing and mixing: src/data/input_stage.py), forward and
loss, loss scaling, gradients, gradient accumulation over micro-batches, data-parallel averaging,
unscaling, global-norm clipping, skipping a step whose gradients are not finite, the optimizer
update and the weight EMA.

Everything happens inside the graph, so sink mode keeps one device call per sink. The cell
returns `(loss, overflow, loss_scale)`, as MindSpore's loss-scaling cells do: `overflow` is True
when the step's gradients were not finite and the update was skipped: weights, optimizer state, EMA
and the BatchNorm statistics its forward pass moved are as before it (the statistics are read at
the start of every step, a few thousand values). A dynamic loss scale then shrinks; otherwise the
divergence guard counts the step, and since the state is still that before it, the step can be
replayed exactly to find where it went non-finite (train.py). A skipped step does not advance the
optimizer's lr schedule (as with the dynamic scale before). (Skipping costs one finiteness check of
the gradients per step; applying NaN gradients would lose the weights.)
A step that clips returns the gradients' global norm before clipping as a fourth output.

Accumulation: one call receives `accumulation_steps` micro-batches stacked into one batch, runs
forward and backward on each in turn and sums their gradients in the graph, so one call is one
optimizer step. The lr schedule, logs, checkpoints and resume therefore all count optimizer steps,
gradients cross the network once per optimizer step, and a checkpoint never holds a half-filled
accumulation buffer.
"""
from dataclasses import dataclass
from typing import Optional

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.communication import get_group_size

from src.errors import UserInputError
from src.training.checkpoint import EMA_PREFIX, STEP_COUNTER

_add = ops.MultitypeFuncGraph("add")
_scale = ops.MultitypeFuncGraph("scale")
_square_sum = ops.MultitypeFuncGraph("square_sum")
_finite = ops.MultitypeFuncGraph("finite")
_ema = ops.MultitypeFuncGraph("ema")
_read = ops.MultitypeFuncGraph("read")
_restore = ops.MultitypeFuncGraph("restore")


@_add.register("Tensor", "Tensor")
def _add_tensors(total, grad):
    return total + grad


@_scale.register("Tensor", "Tensor")
def _scale_tensor(factor, grad):
    return grad * ops.cast(factor, grad.dtype)


@_square_sum.register("Tensor")
def _square_sum_tensor(grad):
    return ops.cast(ops.square(grad).sum(), ms.float32)


@_finite.register("Tensor")
def _finite_tensor(grad):
    # 0 * x is 0 for every finite x and NaN for Inf and NaN, so the sum is finite exactly when every
    # element is: the same answer as isfinite(grad).all(), in half of its CPU time (IsFinite and
    # ReduceAll took 40% of a ResNet18 step at 32 px).
    return ops.isfinite((grad * 0).sum())


@_read.register("Tensor")
def _read_tensor(param):
    return param * 1  # its value now, before the forward pass moves it


@_restore.register("Tensor", "Tensor")
def _restore_tensor(param, value):
    return ops.assign(param, value)


@_ema.register("Tensor", "Tensor", "Tensor")
def _ema_tensor(weight_of_raw, average, raw):
    # weight 1 copies the raw value exactly (0 * average + raw); weight 0 keeps the average exactly.
    alpha = ops.cast(weight_of_raw, average.dtype)
    return ops.assign(average, average * (1 - alpha) + raw * alpha)


@dataclass(frozen=True)
class EmaSchedule:
    """When and how strongly the EMA follows the raw weights (all counted in optimizer steps).

    An update happens at every step whose index within its epoch is a multiple of `every`; it
    copies the raw weights while the step index is <= `copy_until` (the lr warmup, where the
    average is reset, and the first update after it) and otherwise moves `alpha` of the way."""
    alpha: float
    every: int
    steps_per_epoch: int
    copy_until: int


def ema_schedule(*, decay: float, every: int, world_size: int, batch_size: int, accumulation_steps: int,
                 epochs: int, warmup_epochs: int, steps_per_epoch: int) -> EmaSchedule:
    """torchvision's adjustment: alpha = min(1, (1 - decay) * world * batch * every / epochs), where
    `batch` is the images one rank feeds an optimizer step (micro-batch x accumulation)."""
    adjust = world_size * batch_size * accumulation_steps * every / epochs
    return EmaSchedule(alpha=min(1.0, (1.0 - decay) * adjust), every=every, steps_per_epoch=steps_per_epoch,
                       copy_until=warmup_epochs * steps_per_epoch)


def check_ema_decay(decay: float) -> None:
    """model_ema_decay must lie in [0, 1) (model_ema_steps is checked with the positive keys)."""
    if not 0.0 <= decay < 1.0:
        raise UserInputError(f"model_ema_decay must be in [0, 1), got {decay}; torchvision's recipe uses 0.99998")


class NetWithLoss(nn.Cell):
    """The network and the loss; logits are cast to float32 first, so amp O2/O3 compute the loss
    in full precision. Labels pass to the loss as they come (int classes or soft targets)."""

    def __init__(self, net: nn.Cell, loss: nn.Cell):
        super().__init__(auto_prefix=False)
        self.net = net
        self.loss = loss

    def construct(self, images, labels):
        return self.loss(ops.cast(self.net(images), ms.float32), labels)


class ReadyInput(nn.Cell):
    """The input stage for batches that are already the network's input: (images, labels) as they come."""

    def construct(self, images, labels):
        return images, labels


def _data_parallel() -> bool:
    mode = ms.get_auto_parallel_context("parallel_mode")
    return mode in (ms.ParallelMode.DATA_PARALLEL, ms.ParallelMode.HYBRID_PARALLEL)


class TrainStep(nn.Cell):
    """The whole training step; see the module docstring for the order of the parts.

    `loss_scale` multiplies the loss before backward and is divided out of the gradients before
    clipping and the update. `scale_update` (a DynamicLossScaleUpdateCell) makes the scale dynamic:
    non-finite gradients then skip the update and the EMA, and shrink the scale. `ema` averages
    every parameter of `net` (BatchNorm statistics included) into `ema.<name>` parameters.
    `input_stage` turns the dataset's columns into (images, labels) (default: they already are)."""

    def __init__(self, net_with_loss: nn.Cell, optimizer: nn.Cell, *, net: nn.Cell,
                 input_stage: Optional[nn.Cell] = None, loss_scale: float = 1.0,
                 scale_update: Optional[nn.Cell] = None, accumulation_steps: int = 1, micro_batch: int = 0,
                 clip_grad_norm: float = 0.0, ema: Optional[EmaSchedule] = None,
                 all_finite: Optional[nn.Cell] = None, unscale_all_finite: Optional[nn.Cell] = None,
                 momentum_step: Optional[nn.Cell] = None):
        super().__init__(auto_prefix=False)
        self.input_stage = input_stage or ReadyInput()
        # One op over every gradient (1 when all are finite), or None: a check per gradient; and
        # one that also divides the loss scale out of them (factor, *grads -> *grads, finite), or
        # None: a multiplication per gradient, then the check.
        self.all_finite = all_finite
        self.unscale_all_finite = unscale_all_finite
        # Or, for nn.Momentum without clipping, one op that also decays and updates the weights
        # (src.cpu_layers.momentum_step_op): (factor, lr, momentum, decays, *grads, *weights,
        # *moments) -> 1 when the step was applied; the optimizer keeps its state, not its construct.
        self.momentum_step = momentum_step
        if momentum_step is not None:
            self.decays = Tensor([float(decay) if flag else 0.0 for decay, flag in
                                  zip(optimizer.group_weight_decay, optimizer.decay_flags)], ms.float32)
        self.network = net_with_loss
        self.network.set_grad()
        self.optimizer = optimizer
        self.weights = optimizer.parameters
        self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
        self.hyper_map = ops.HyperMap()
        self.dynamic = scale_update is not None
        self.scale_update = scale_update
        self.unscale = self.dynamic or loss_scale != 1.0
        if self.dynamic:
            self.scale_sense = Parameter(Tensor(loss_scale, ms.float32), name="scale_sense", requires_grad=False)
        else:
            self.scale_sense = Tensor(loss_scale, ms.float32)
        self.accumulation_steps = accumulation_steps
        if accumulation_steps > 1 or momentum_step is not None:
            self.scaled_value_and_grad = ms.value_and_grad(self.scaled_loss, None, self.weights, has_aux=True)
        self.micro_batch = micro_batch
        self.clip = clip_grad_norm > 0
        self.clip_grad_norm = Tensor(clip_grad_norm, ms.float32)
        self.reduce = _data_parallel()
        if self.reduce:
            self.reducer = nn.DistributedGradReducer(self.weights, ms.get_auto_parallel_context("gradients_mean"),
                                                     get_group_size())
        # BatchNorm's statistics: the forward pass moves them; a skipped step puts them back.
        self.statistics = ParameterTuple([stat for _, cell in net.cells_and_names() if isinstance(cell, nn.BatchNorm2d)
                                          for stat in (cell.moving_mean, cell.moving_variance)])
        self.use_ema = ema is not None
        if self.use_ema:
            raw = list(net.get_parameters())
            self.raw_params = ParameterTuple(raw)
            self.ema_params = ParameterTuple(
                [Parameter(Tensor(p.asnumpy()), name=EMA_PREFIX + p.name, requires_grad=False) for p in raw])
            self.train_steps = Parameter(Tensor(0, ms.int32), name=STEP_COUNTER, requires_grad=False)
            self.ema_alpha = Tensor(ema.alpha, ms.float32)
            self.ema_every, self.steps_per_epoch, self.ema_copy_until = ema.every, ema.steps_per_epoch, ema.copy_until

    def gradients(self, images, labels, sens):
        """Mean loss and summed, still scaled, gradients over the micro-batches of one step."""
        if self.momentum_step is not None and self.accumulation_steps == 1:
            # With the weights written by an op of the step itself, GRAPH mode ran the loss's forward
            # apart from the gradient's and moved the BatchNorm statistics twice: one pass.
            return self.micro_batch_gradients(images, labels, sens)
        if self.accumulation_steps == 1:
            loss = self.network(images, labels)
            return loss, self.grad(self.network, self.weights)(images, labels, sens)
        image_parts = ops.split(images, self.micro_batch, 0)
        label_parts = ops.split(labels, self.micro_batch, 0)
        loss, grads = self.micro_batch_gradients(image_parts[0], label_parts[0], sens)
        for i in range(1, self.accumulation_steps):
            part_loss, part_grads = self.micro_batch_gradients(image_parts[i], label_parts[i], sens)
            loss = loss + part_loss
            grads = self.hyper_map(_add, grads, part_grads)
        steps = Tensor(self.accumulation_steps, ms.float32)
        return loss / steps, self.hyper_map(ops.partial(_scale, 1 / steps), grads)

    def micro_batch_gradients(self, images, labels, sens):
        """One forward and backward of a micro-batch: its loss and its gradients times `sens`.

        One pass, not a forward for the loss and another inside the gradient: in GRAPH mode the
        two were not merged across the micro-batch loop, so every micro-batch moved the BatchNorm
        statistics twice (train_parity.py found it)."""
        (_, loss), grads = self.scaled_value_and_grad(images, labels, sens)
        return loss, grads

    def scaled_loss(self, images, labels, sens):
        loss = self.network(images, labels)
        return loss * ops.cast(sens, loss.dtype), loss

    def clip_by_global_norm(self, grads):
        """Scale all gradients by min(1, clip / (norm + 1e-6)), norm over all of them (as torch does);
        returns the clipped gradients and the norm before clipping."""
        norm = ops.sqrt(ops.addn(self.hyper_map(_square_sum, grads)))
        factor = ops.minimum(self.clip_grad_norm / (norm + 1e-6), 1.0)
        return self.hyper_map(ops.partial(_scale, factor), grads), norm

    def update_ema(self, step):
        due = (step % self.steps_per_epoch) % self.ema_every == 0
        weight = ops.select(step <= self.ema_copy_until, Tensor(1.0, ms.float32), self.ema_alpha)
        weight = ops.select(due, weight, Tensor(0.0, ms.float32))
        return self.hyper_map(ops.partial(_ema, weight), self.ema_params, self.raw_params)

    def momentum_step_applied(self, grads, scale):
        """The whole update in one op (see momentum_step): whether it was applied (all finite)."""
        optimizer = self.optimizer
        factor = ops.reshape(1 / scale, (1,)) if self.unscale else Tensor([1.0], ms.float32)
        applied = self.momentum_step(factor, optimizer.get_lr(), optimizer.momentum, self.decays, *grads,
                                     *self.weights, *optimizer.moments)
        return applied[0] > 0.5

    def apply(self, grads, step):
        """The optimizer update (with momentum_step: its step count alone, the op has moved the
        weights), then the EMA of the updated weights."""
        if self.momentum_step is not None:
            done = ops.assign_add(self.optimizer.global_step, self.optimizer.global_step_increase_tensor)
        else:
            done = self.optimizer(grads)
        if self.use_ema:
            done = ops.depend(done, self.update_ema(ops.depend(step, done)))
        return done

    def construct(self, *columns):
        images, labels = self.input_stage(*columns)  # no weights: outside the gradient
        scale = self.scale_sense * 1  # this step's scale, read before a dynamic update changes it
        step = self.train_steps * 1 if self.use_ema else 0
        statistics = self.hyper_map(_read, self.statistics) if self.statistics else ()
        loss, grads = self.gradients(images, labels, scale)
        if self.reduce:
            grads = self.reducer(grads)  # once per optimizer step, also with accumulation
        if self.momentum_step is not None:
            overflow = ops.logical_not(self.momentum_step_applied(grads, scale))
        elif self.unscale and self.unscale_all_finite is not None:
            unscaled = self.unscale_all_finite(ops.reshape(1 / scale, (1,)), *grads)
            grads, overflow = unscaled[:-1], unscaled[-1][0] < 0.5
        else:
            if self.unscale:
                grads = self.hyper_map(ops.partial(_scale, 1 / scale), grads)
            if self.all_finite is None:
                overflow = ops.logical_not(ops.stack(self.hyper_map(_finite, grads)).all())
            else:
                overflow = self.all_finite(*grads)[0] < 0.5
        if self.dynamic:
            overflow = self.scale_update(self.scale_sense, overflow)
        norm = Tensor(0.0, ms.float32)
        if self.clip:
            grads, norm = self.clip_by_global_norm(grads)
        if not overflow:
            loss = ops.depend(loss, self.apply(grads, step))
        elif self.statistics:
            loss = ops.depend(loss, self.hyper_map(_restore, self.statistics, statistics))
        if self.use_ema:
            loss = ops.depend(loss, ops.assign_add(self.train_steps, Tensor(1, ms.int32)))
        if self.clip:
            return loss, overflow, scale, norm
        return loss, overflow, scale
