"""Data-parallel training: the state each rank moves with its own batches, made one network's.

Gradients are averaged over the ranks, so the weights stay equal; BatchNorm's moving statistics
and the ranges of QAT's fake quantizers are not gradients: each rank moves them with its own
shard's batches. Left alone, every rank holds a different network, and the in-training evaluation
(every rank scores its shard of the evaluation set with its own network, the counts summed) scored
a mixture of networks of which the checkpoints saved one (rank 0's).

`RankStatistics` makes them equal on every rank, as timm's `distribute_bn(reduce=True)` does: the
moving mean and variance become their mean over the ranks, the quantizer ranges the widest any rank
holds (the range one process would hold after the ranks' last batches together; SimQAT's ranges are
the last batch's, not an average, since the quantizers apply_qat builds keep no EMA). The EMA copies
of them (model_ema) are made equal the same way. It does so at fixed global steps: at every epoch
end (before the evaluation and the epoch's checkpoint), before every mid-epoch checkpoint and
before a stop signal's checkpoint, so what is evaluated is what is saved.

Why resume stays exact: training never reads these values (a forward pass in training normalizes
with the batch's statistics; SimQAT's range update ignores the old range), so the weights are as
without it; and every checkpoint is written right after a synchronization, so a resumed run, whose
ranks all load those equal values, has what the uninterrupted run had after the same
synchronization. The synchronization points of periodic checkpoints follow the checkpoint schedule
on every rank. A stop signal's checkpoint falls at an arbitrary step: the run resumed from it
matches the uninterrupted one to float32 rounding in the statistics (the moving averages are linear
in their old values, so averaging earlier changes the later mean by rounding only) and exactly in
the weights. One process (group size 1) has nothing to make equal: no callback, nothing changes.
"""
from typing import Dict, List, Optional, Sequence

import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from src.collective import all_reduce_sum
from src.compression import QUANTIZER_MARK
from src.training.callbacks import SaveSchedule, StepCounter
from src.training.checkpoint import EMA_PREFIX

MIN_SUFFIX = "_float_min"  # a range's lower end: the widest is the least over ranks (upper ends: the greatest)


def moving_statistics(net: nn.Cell) -> List[Parameter]:
    """The moving mean and variance of every BatchNorm of `net` (this repository's oneDNN cells are
    BatchNorm2d too) whose statistics move in training; frozen ones (freeze_bn, freeze_backbone)
    never move, so they stay equal on every rank."""
    return [stat for _, cell in net.cells_and_names()
            if isinstance(cell, nn.BatchNorm2d) and cell.use_batch_statistics is not False
            for stat in (cell.moving_mean, cell.moving_variance)]


def quantizer_ranges(net: nn.Cell) -> List[Parameter]:
    """The fake quantizers' ranges that training moves with the batches; a learned one (a trainable
    parameter) takes the averaged gradients like a weight, so it is equal on every rank already."""
    return [param for param in net.get_parameters() if QUANTIZER_MARK in param.name and not param.requires_grad]


def with_ema_copies(params: Sequence[Parameter], ema_params: Optional[Sequence[Parameter]]) -> List[Parameter]:
    """`params` and, when the train step keeps an EMA of the network, their EMA copies."""
    if ema_params is None:
        return list(params)
    copies: Dict[str, Parameter] = {p.name: p for p in ema_params}
    return list(params) + [copies[EMA_PREFIX + p.name] for p in params]


def _flat(params: Sequence[Parameter]) -> np.ndarray:
    if not params:
        return np.zeros(0, np.float64)
    return np.concatenate([p.asnumpy().astype(np.float64).ravel() for p in params])


def _split(params: Sequence[Parameter], values: np.ndarray) -> List[Tensor]:
    """`values` (flat, in the order of `params`) as one tensor per parameter, in its shape and type."""
    tensors, offset = [], 0
    for param in params:
        old = param.asnumpy()
        tensors.append(Tensor(values[offset:offset + old.size].reshape(old.shape).astype(old.dtype)))
        offset += old.size
    return tensors


def equal_values(averaged: Sequence[Parameter], widest: Sequence[Parameter], *, rank: int,
                 group_size: int) -> List[Tensor]:
    """The values every rank gives `averaged` (their mean over the ranks) and `widest` (the widest
    range over the ranks), in that order, from one allreduce: the sums of `averaged`, then a row
    per rank of `widest` (each rank fills its own row, the others send zeros: gathered exactly).
    Float32 on the wire, as these parameters are; every rank gets the same sums, so the same values."""
    sums, ranges = _flat(averaged), _flat(widest)
    rows = np.zeros((group_size, ranges.size), np.float64)
    rows[rank] = ranges
    reduced = all_reduce_sum(np.concatenate([sums, rows.ravel()]))
    gathered = reduced[sums.size:].reshape(group_size, ranges.size)
    lower = np.concatenate([np.full(p.asnumpy().size, p.name.endswith(MIN_SUFFIX)) for p in widest] or [[]])
    return (_split(averaged, reduced[:sums.size] / group_size)
            + _split(widest, np.where(lower, gathered.min(axis=0), gathered.max(axis=0))))


class _Assign(nn.Cell):
    """Writes values into parameters with Assign, in a graph. (Parameter.set_data after the train
    step compiled left the step's EMA update writing where the parameter no longer read: the EMA
    copies never moved again. An Assign writes where the train step reads.)"""

    def __init__(self, params: Sequence[Parameter]):
        super().__init__(auto_prefix=False)
        self.params = ParameterTuple(params)
        self.hyper_map = ops.HyperMap()

    def construct(self, values):
        return self.hyper_map(ops.assign, self.params, values)


class RankStatistics(StepCounter):
    """Makes the ranks' moving statistics and quantizer ranges equal (see the module docstring) at
    every epoch end and at the mid-epoch steps where `schedule` (the checkpoints') saves; `sync(step)`
    does it for a stop signal's checkpoint. Put it before the evaluation and the checkpoint saver
    among the callbacks. Every rank runs it (an allreduce), writer or not."""

    def __init__(self, *, averaged: Sequence[Parameter], widest: Sequence[Parameter], rank: int, group_size: int,
                 schedule: SaveSchedule, first_step: int = 0):
        super().__init__(schedule.steps_per_epoch, first_step)
        self.averaged, self.widest = list(averaged), list(widest)
        self.rank, self.group_size, self.schedule = rank, group_size, schedule
        self.assign = _Assign(self.averaged + self.widest)
        self.synced_step = -1

    def sync(self, step: int) -> None:
        """Make them equal after global `step`, unless that was done already."""
        if step != self.synced_step:
            self.assign(tuple(equal_values(self.averaged, self.widest, rank=self.rank, group_size=self.group_size)))
            self.synced_step = step

    def on_train_step_end(self, run_context) -> None:
        step = self.global_step(run_context)
        if self.schedule.due_in_epoch(step):
            self.sync(step)
            self.schedule.saved(step)

    def on_train_epoch_end(self, run_context) -> None:
        step = self.global_step(run_context)
        self.sync(step)
        if self.schedule.due_at_epoch_end(run_context.original_args().cur_epoch_num):
            self.schedule.saved(step)


def rank_statistics(net: nn.Cell, *, ema_params: Optional[Sequence[Parameter]], rank: int, group_size: int,
                    schedule: SaveSchedule, first_step: int = 0) -> Optional[RankStatistics]:
    """The callback for a data-parallel run of `net`, or None: one process, or nothing that moves
    per rank (every BatchNorm frozen, no quantizer)."""
    averaged, widest = moving_statistics(net), quantizer_ranges(net)
    if group_size <= 1 or not (averaged or widest):
        return None
    return RankStatistics(averaged=with_ema_copies(averaged, ema_params), widest=with_ema_copies(widest, ema_params),
                          rank=rank, group_size=group_size, schedule=schedule, first_step=first_step)
