"""Storage system calls per training sample (files opened, read calls), counted by strace over a
measuring process of its own (benchmark.py --worker storage): what a network file system charges
per call, which the page cache hides."""
import argparse
import os
import shutil
import tempfile
from typing import Dict, Optional, Tuple

from tools.benchmarking.pipelines import our_dataset
from tools.benchmarking.worker import entry_command, reply, run_worker

# opened (and missing) around the counted batches: where they start and end in strace's log
STORAGE_MARK = "/benchmark-storage-mark"
# Only the calls counted (and the marks' open): the stat family, three quarters of the calls the
# process's imports make, would stop it under strace for nothing (~2 CPU-s per traced process).
STORAGE_CALLS = "openat,open,read,pread64,readv,preadv"
READ_CALLS = ("read", "pread64", "readv", "preadv")


def serve_storage(args: argparse.Namespace) -> int:
    """The process strace watches: the training pipeline on --photo_dir (one worker), one batch to
    start, then --steps batches between two marks."""
    data = our_dataset(args.photo_dir, training=True, batch=args.photo_batch, workers=1)
    iterator = data.repeat(-1).create_tuple_iterator(num_epochs=1, output_numpy=True)
    next(iterator)
    _mark()
    samples = sum(len(next(iterator)[1]) for _ in range(args.steps))
    _mark()
    reply({"samples": samples})
    return 0


def _mark() -> None:
    try:
        os.close(os.open(STORAGE_MARK, os.O_RDONLY))
    except FileNotFoundError:
        pass


def storage_calls(path: str, *, batch: int, batches: int) -> Optional[Dict[str, float]]:
    """Files opened and read calls on the data's files per 1,000 training samples, counted by
    strace over the process, its threads and workers: what a network file system charges per call,
    which this machine's page cache hides. None without strace."""
    if shutil.which("strace") is None:
        return None
    with tempfile.TemporaryDirectory(prefix="storage-calls-") as folder:
        log = os.path.join(folder, "calls.log")
        command = ["strace", "-f", "--seccomp-bpf", "-y", "-qq", "-e", f"trace={STORAGE_CALLS}", "-o", log,
                   *entry_command("--worker", "storage", "--photo_dir", path,
                                  "--photo_batch", str(batch), "--steps", str(batches))]
        answer = run_worker(command, "storage")
        opened, reads = count_storage_calls(log, os.path.realpath(path))
    per_thousand = 1000 / answer["samples"]
    return {"files_opened": round(opened * per_thousand, 1), "read_calls": round(reads * per_thousand, 1)}


def count_storage_calls(log: str, root: str) -> Tuple[int, int]:
    """(files opened under `root`, read calls on them) between the two marks of an strace -f -y log."""
    opened = reads = 0
    inside = False
    with open(log) as lines:
        for line in lines:
            if STORAGE_MARK in line:
                inside = not inside
                continue
            call = line.split(" ", 1)[-1].lstrip()
            name = call.split("(", 1)[0]
            if not inside or call.startswith("<..."):
                continue  # a call resumed was counted where it started
            if name in ("open", "openat") and f'"{root}' in call and " = -1 " not in call:
                opened += 1
            elif name in READ_CALLS and f"<{root}" in call.split(",", 1)[0]:
                reads += 1
    return opened, reads

