"""Collectives over a run's ranks for small host-side values (counts, steps, flags): the
evaluation's sums, the ranks' agreement on where to resume and when to stop, the barriers before a
run's end and the rank statistics exchange."""
from typing import List

import mindspore as ms
import numpy as np
from mindspore import nn, ops


class _AllReduceSum(nn.Cell):
    def __init__(self):
        super().__init__()
        self.all_reduce = ops.AllReduce()

    def construct(self, x):
        return self.all_reduce(x)


_ALL_REDUCE: List[_AllReduceSum] = []  # one cell, built on first use, so its graph compiles once


def all_reduce_sum(values: np.ndarray) -> np.ndarray:
    """Sum a small float64 vector over all ranks (float32 on the wire; exact for counts < 2**24)."""
    if not _ALL_REDUCE:
        _ALL_REDUCE.append(_AllReduceSum())
    return _ALL_REDUCE[0](ms.Tensor(values.astype(np.float32))).asnumpy().astype(np.float64)


def all_gather_ints(value: int, rank: int, group_size: int) -> List[int]:
    """Every rank's `value` (a small integer >= -1), in rank order, on every rank."""
    mine = np.zeros(group_size, dtype=np.float64)
    mine[rank] = value + 1  # 0 stands for the other ranks' slots
    return [int(v) - 1 for v in all_reduce_sum(mine)]


def rank_sum(value: int, group_size: int) -> int:
    """The sum of each rank's small integer `value` (with flags: how many ranks raise it); with
    several ranks, also a barrier: every rank has got this far."""
    if group_size == 1:
        return value
    return int(all_reduce_sum(np.array([value], dtype=np.float64))[0])


def barrier(group_size: int) -> None:
    """Wait until every rank has got this far."""
    rank_sum(0, group_size)
