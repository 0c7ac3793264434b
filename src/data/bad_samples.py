"""Unreadable samples (a corrupt or undecodable image): recorded, counted per epoch, bounded by
`max_bad_samples`, and found up front by `--check_data True`.

The record is a small tab-separated file that every data worker process appends to (one short
line per write, so appends from several processes never interleave), which lets the training
process count an epoch's replacements whatever the number of workers."""
import fcntl
import math
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import List, Tuple

from src.errors import UserInputError

# Errors PIL (and our loaders) raise for a file that cannot be opened or decoded.
UNREADABLE_ERRORS = (OSError, ValueError, SyntaxError)
DEFAULT_FRACTION = 0.001  # max_bad_samples -1: 0.1% of the dataset
MAX_LISTED = 5


def bad_sample_limit(max_bad_samples: int, dataset_size: int) -> int:
    """The number of distinct unreadable files tolerated: the key's value, or 0.1% of the
    dataset (rounded up) for -1."""
    if max_bad_samples < -1:
        raise UserInputError(f"max_bad_samples must be >= 0, or -1 for 0.1% of the dataset; got {max_bad_samples}")
    if max_bad_samples == -1:
        return math.ceil(DEFAULT_FRACTION * dataset_size)
    return max_bad_samples


class UnreadableImageError(UserInputError):
    """An image file that cannot be opened or decoded; `reason` is what the decoder said."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"cannot read image {path} ({reason}); remove or replace the file")
        self.reason = reason


def reason_of(err: BaseException) -> str:
    """The decoder's one-line reason for an unreadable sample."""
    text = getattr(err, "reason", None) or str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:200]


class BadSampleLog:
    """Appends `epoch<TAB>index<TAB>file<TAB>reason` lines to `path`; stops the run once more than
    `limit` distinct files were unreadable. Plain attributes only: it travels to worker processes,
    so the file is the one record they share (a file is warned about once per run, by whichever
    process records it first)."""

    def __init__(self, path: str, limit: int, warn: bool = True):
        self.path, self.limit, self.warn = path, limit, warn

    def reset(self) -> None:
        """Start a new record (at the start of a run or a resumed run)."""
        if os.path.exists(self.path):
            os.remove(self.path)

    def _entries(self) -> List[Tuple[int, int, str]]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, encoding="utf-8") as handle:
            rows = [line.rstrip("\n").split("\t") for line in handle if line.count("\t") >= 3]
        return [(int(row[0]), int(row[1]), row[2]) for row in rows]

    def add(self, epoch: int, index: int, name: str, reason: str) -> None:
        """Record sample `index` of sampler epoch `epoch` (0-based) as unreadable; raise once the
        distinct unreadable files exceed the limit."""
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)  # a rank may get here before rank 0
        with open(self.path, "a+", encoding="utf-8") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # read and append as one step: processes meet files concurrently
            handle.seek(0)
            first = not any(line.split("\t")[2:3] == [name] for line in handle)
            handle.write(f"{epoch}\t{index}\t{name}\t{reason.replace(chr(9), ' ')}\n")
        if first and self.warn:
            print(f"warning: skipped unreadable image {name} ({reason}); replaced by the next readable sample",
                  file=sys.stderr, flush=True)
        raise_if_too_many(self.files(), self.limit, "--check_data True lists all")

    def files(self) -> List[str]:
        """The distinct unreadable files recorded, in the order met."""
        return list(dict.fromkeys(name for _, _, name in self._entries()))

    def count(self, epoch: int) -> int:
        """Samples replaced in training epoch `epoch` (1-based, as the training callbacks count)."""
        return sum(1 for recorded, _, _ in self._entries() if recorded == epoch - 1)


def raise_if_too_many(files: List[str], limit: int, where_listed: str) -> None:
    """Stop with one line listing the first files when more than `limit` are unreadable."""
    if len(files) > limit:
        shown = ", ".join(files[:MAX_LISTED]) + (f", ... (+{len(files) - MAX_LISTED})" if len(files) > MAX_LISTED
                                                 else "")
        raise UserInputError(f"{len(files)} unreadable images, more than max_bad_samples {limit}: {shown}; fix or "
                             f"remove them ({where_listed}), or raise --max_bad_samples")


def sample_name(source, index: int) -> str:
    """The file behind sample `index` (class folders), or its number (CIFAR-10 records)."""
    paths = getattr(source, "paths", None)
    return paths[index] if paths is not None else f"sample {index}"


_WORKER_SOURCE = []  # the source, handed once to each scan worker process


def _set_worker_source(source) -> None:
    _WORKER_SOURCE[:] = [source]


def _check_range(start: int, stop: int, source=None) -> List[Tuple[str, str]]:
    source = source if source is not None else _WORKER_SOURCE[0]
    found = []
    for index in range(start, stop):
        try:
            source.check(index)
        except UNREADABLE_ERRORS as err:
            found.append((sample_name(source, index), reason_of(err)))
    return found


def scan_unreadable(source, workers: int = 1) -> List[Tuple[str, str]]:
    """Open and decode every sample of `source` once; returns (file, reason) of each unreadable one."""
    total = len(source)
    if workers <= 1:
        return _check_range(0, total, source)
    chunk = max(1, math.ceil(total / (workers * 16)))
    starts = list(range(0, total, chunk))
    # Spawned, not forked: a process that already ran a MindSpore pipeline holds threads (and worker
    # processes) a forked child inherits half of, and such a child crashed or hung.
    with ProcessPoolExecutor(max_workers=workers, initializer=_set_worker_source, initargs=(source,),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        results = pool.map(_check_range, starts, [min(start + chunk, total) for start in starts])
        return [item for found in results for item in found]
