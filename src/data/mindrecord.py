"""Convert class folders or CIFAR-10 binary files into MindRecord shards (src/data/shards.py).

    python -m src.data.mindrecord --data_path /data/imagenet --output /data/imagenet_mr
    python -m src.data.mindrecord --data_path /data/imagenet/train --output /data/imagenet_mr/train --shards 256

A dataset root (train/ beside val/ or test/, or CIFAR-10's binary files: data_batch_* to train/,
test_batch.bin to val/) becomes one shard folder per split under --output, so `--data_path OUTPUT`
replaces `--data_path DATA` in any command; a folder of class folders becomes one shard folder.
Images are stored as their files hold them (not re-encoded). Shards are written by --workers
processes into `<folder>.partial/`, each checked (record count, order, labels) and marked done;
the manifest comes last and the folder is renamed into place, so an interrupted conversion never
looks finished, and running the command again keeps the shards already done.
"""
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import mindspore.dataset as ds
import numpy as np
from mindspore.mindrecord import FileWriter

from src.data.image_decode import read_file
from src.data.shards import (
    CLASS_LIST,
    ENCODED,
    FORMAT,
    MANIFEST,
    PIXELS,
    SCHEMA,
    SCHEMA_NAME,
    mindspore_reason,
    read_header,
    read_manifest,
    records_in,
    shard_name,
)
from src.data.sources import CifarBinarySource, ImageFolderSource
from src.errors import OneLineParser, UserInputError, run_cli
from src.files import remove_stale_temporaries, write_atomic

SHARD_BYTES = 256 << 20  # default shard size: large sequential reads, a few hundred files for ImageNet
ROWS_PER_WRITE = 256
PLAN = "plan.json"
DONE = ".done"


def find_splits(data_path: str) -> List[Tuple[str, object]]:
    """(split folder name, source) of each split to convert; name '' for a lone class folder."""
    if not os.path.isdir(data_path):
        raise UserInputError(f"source folder not found: {data_path}; pass --data_path with a class folder, "
                             f"a dataset root or CIFAR-10's binary files")
    cifar = data_path if _has_cifar(data_path) else os.path.join(data_path, "cifar-10-batches-bin")
    if _has_cifar(cifar):
        splits = [("train", CifarBinarySource(cifar, True))]
        if os.path.isfile(os.path.join(cifar, "test_batch.bin")):
            splits.append(("val", CifarBinarySource(cifar, False)))
        return splits
    if os.path.isdir(os.path.join(data_path, "train")):
        return [("train", ImageFolderSource(data_path, True))] + [
            (name, ImageFolderSource(data_path, False, eval_folder=name))
            for name in ("val", "test") if os.path.isdir(os.path.join(data_path, name))]
    return [("", ImageFolderSource(data_path, True))]


def _has_cifar(folder: str) -> bool:
    return os.path.isdir(folder) and any(name.startswith("data_batch_") and name.endswith(".bin")
                                         for name in os.listdir(folder))


def kind_of(source) -> str:
    return PIXELS if isinstance(source, CifarBinarySource) else ENCODED


def record_path(source, index: int) -> str:
    if kind_of(source) == PIXELS:
        return f"record {index}"
    return os.path.relpath(source.paths[index], source.root)


def image_bytes(source, index: int) -> bytes:
    if kind_of(source) == PIXELS:
        return source.images[index].tobytes()
    return read_file(source.paths[index])


def default_shards(source) -> int:
    """About SHARD_BYTES per shard, from the sizes of up to 100 of the source's images."""
    total = len(source)
    picks = np.linspace(0, total - 1, min(total, 100)).astype(int)
    if kind_of(source) == PIXELS:
        mean = source.images[0].nbytes
    else:
        mean = float(np.mean([os.path.getsize(source.paths[i]) for i in picks]))
    return max(1, min(total, 1000, math.ceil(total * mean / SHARD_BYTES)))


def source_files(source) -> List[List]:
    """Each image file of a folder source: [name, size, modification time in ns], as build tools
    tell a changed file (a file replaced under the same name changes its size or time)."""
    if kind_of(source) == PIXELS:
        return []
    files = []
    for path in source.paths:
        stat = os.stat(path)
        files.append([os.path.relpath(path, source.root), stat.st_size, stat.st_mtime_ns])
    return files


def fingerprint(source, files: Optional[List[List]] = None) -> str:
    """What identifies the source's records (their order, labels, and the files' names, sizes and
    times, or the pixels), for resuming and for telling a stale conversion."""
    digest = hashlib.sha256(np.ascontiguousarray(source.labels).tobytes())
    if kind_of(source) == PIXELS:
        digest.update(source.images.tobytes())
    else:
        digest.update(json.dumps(source_files(source) if files is None else files).encode())
    return digest.hexdigest()


def changed_files(manifest: Dict, files: List[List], shown: int = 5) -> str:
    """The files that differ between a conversion's manifest and the source now, in a phrase."""
    if files and "files" not in manifest:
        return "converted by an earlier version, which did not record the files' sizes and times"
    before = {name: (size, time) for name, size, time in manifest.get("files") or []}
    now = {name: (size, time) for name, size, time in files}
    changed = [name for name in now if name in before and before[name] != now[name]]
    added = [name for name in now if name not in before]
    removed = [name for name in before if name not in now]
    parts = [f"{what}: {', '.join(names[:shown])}" + (f" (+{len(names) - shown})" if len(names) > shown else "")
             for what, names in (("changed", changed), ("new", added), ("gone", removed)) if names]
    return "; ".join(parts) or "the labels or the order of the images differ"


def shard_bounds(total: int, shards: int) -> List[Tuple[int, int]]:
    return [(shard * total // shards, (shard + 1) * total // shards) for shard in range(shards)]


_SOURCE: list = []  # the source, inherited by the forked writer processes


def write_shard(task: Tuple[str, int, int, int, int]) -> Dict:
    """Write one shard and check it: its record count, the records' order and labels; then mark it
    done. Returns what the manifest lists of it."""
    folder, shard, count, start, end = task
    source = _SOURCE[0]
    path = os.path.join(folder, shard_name(shard, count))
    try:
        writer = FileWriter(path, shard_num=1, overwrite=True)
        writer.add_schema(SCHEMA, SCHEMA_NAME)
        writer.add_index(["index", "label"])
        for first in range(start, end, ROWS_PER_WRITE):
            writer.write_raw_data([{"index": index, "label": int(source.labels[index]),
                                    "path": record_path(source, index), "image": image_bytes(source, index)}
                                   for index in range(first, min(first + ROWS_PER_WRITE, end))])
        writer.commit()
    except (OSError, RuntimeError) as err:  # MindSpore's writer reports a full disk as a RuntimeError
        raise UserInputError(f"cannot write shard {path} ({mindspore_reason(err)}); free space or fix "
                             f"permissions, then run the same command again (the shards already done are kept)"
                             ) from None
    check_shard(path, start, end, source.labels)
    entry = {"file": os.path.basename(path), "records": end - start, "bytes": os.path.getsize(path)}
    write_atomic(path + DONE, json.dumps(entry))  # a kill leaves no half-written marker
    return entry


def check_shard(path: str, start: int, end: int, labels: np.ndarray) -> None:
    """The shard holds records start..end-1 in order, with the source's labels."""
    held = records_in(read_header(path))
    if held != end - start:
        raise UserInputError(f"{path} holds {held} records, {end - start} were written; check the free space "
                             f"and run the conversion again")
    data = ds.MindDataset(path, columns_list=["index", "label"], shuffle=False, num_parallel_workers=1)
    rows = np.array([(int(i), int(y)) for i, y in data.create_tuple_iterator(num_epochs=1, output_numpy=True)],
                    np.int64).reshape(-1, 2)
    if not (np.array_equal(rows[:, 0], np.arange(start, end)) and np.array_equal(rows[:, 1], labels[start:end])):
        raise UserInputError(f"{path} does not read back as written (order or labels differ); run the "
                             f"conversion again")


def prepare_partial(partial: str, plan: Dict) -> List[Dict]:
    """The shards already done in `partial` for this plan (an interrupted run's); anything else
    there, from another plan or half-written, is removed."""
    plan_file = os.path.join(partial, PLAN)
    if _read_json(plan_file) != plan:
        shutil.rmtree(partial, ignore_errors=True)
        write_atomic(plan_file, json.dumps(plan))
        return []
    remove_stale_temporaries(partial)
    done = []
    for name in sorted(os.listdir(partial)):
        entry = _read_json(os.path.join(partial, name)) if name.endswith(DONE) else None
        shard = os.path.join(partial, entry["file"]) if entry else ""
        # a kill between a shard's two files leaves one of them: that shard is written again
        if (entry and os.path.isfile(shard) and os.path.isfile(shard + ".db")
                and os.path.getsize(shard) == entry["bytes"]):
            done.append(entry)
    return done


def _read_json(path: str) -> Optional[Dict]:
    try:
        with open(path) as stream:
            return json.load(stream)
    except (OSError, ValueError):
        return None


def convert_split(source, output: str, *, shards: Optional[int], workers: int, overwrite: bool,
                  log=print) -> Dict:
    """Convert one split into `output`; returns its manifest."""
    total = len(source)
    shards = min(shards or default_shards(source), total)
    files = source_files(source)
    plan = {"records": total, "shards": shards, "kind": kind_of(source), "fingerprint": fingerprint(source, files)}
    if os.path.isfile(os.path.join(output, MANIFEST)) and not overwrite:
        manifest = read_manifest(output)
        if manifest.get("fingerprint") == plan["fingerprint"]:
            remove_markers(output)  # a kill after the finished folder was renamed into place left them
            log(f"{output}: already converted ({total} records in {len(manifest['shards'])} shards)")
            return manifest
        raise UserInputError(f"{output} already holds a conversion of other images "
                             f"({changed_files(manifest, files)}); pass --overwrite to convert again, or choose "
                             f"another --output")
    if os.path.exists(output) and not os.path.isfile(os.path.join(output, MANIFEST)) and os.listdir(output):
        raise UserInputError(f"{output} exists and is no finished conversion; remove it or choose another --output")
    partial = output.rstrip(os.sep) + ".partial"
    done = prepare_partial(partial, plan)
    finished = {entry["file"] for entry in done}
    bounds = shard_bounds(total, shards)
    tasks = [(partial, shard, shards, start, end) for shard, (start, end) in enumerate(bounds)
             if shard_name(shard, shards) not in finished]
    if done:
        log(f"{output}: {len(done)} of {shards} shards already written, writing the other {len(tasks)}")
    entries = done + write_shards(tasks, source, workers=workers, shards=shards, already=len(done), log=log,
                                  label=output)
    entries.sort(key=lambda entry: entry["file"])
    manifest = {"format": FORMAT, "kind": kind_of(source), "records": total,
                "pixel_shape": list(source.images.shape[1:]) if kind_of(source) == PIXELS else None,
                "fingerprint": plan["fingerprint"], "class_names": list(source.class_names),
                "shards": entries, "labels": source.labels.tolist(), "files": files}
    if sum(entry["records"] for entry in entries) != total:
        raise UserInputError(f"{partial} holds {sum(e['records'] for e in entries)} records, the source "
                             f"{total}; run the conversion again")
    # In an order that no kill can cost a finished shard: the plan and the done markers stay until
    # the finished folder is in place (a rerun before that finds every shard done and finishes).
    write_atomic(os.path.join(partial, CLASS_LIST), "".join(f"{name}\n" for name in source.class_names))
    write_atomic(os.path.join(partial, MANIFEST), json.dumps(manifest))
    _replace(partial, output)
    remove_markers(output)
    log(f"{output}: {total} records in {shards} shards, "
        f"{sum(disk_bytes(output, entry['file']) for entry in entries) / 2**20:.1f} MB on disk")
    return manifest


def remove_markers(folder: str) -> None:
    """The plan and the done markers of a conversion, once it is finished."""
    for name in os.listdir(folder):
        if name.endswith(DONE) or name == PLAN:
            os.remove(os.path.join(folder, name))


def write_shards(tasks: Sequence[Tuple], source, *, workers: int, shards: int, already: int, log,
                 label: str) -> List[Dict]:
    """Write `tasks` in `workers` processes, logging each finished shard."""
    _SOURCE[:] = [source]
    entries, records, written = [], 0, 0
    started = time.perf_counter()
    context = multiprocessing.get_context("fork")  # the writers inherit the source instead of reading it again
    with context.Pool(max(1, min(workers, len(tasks) or 1))) as pool:
        for entry in pool.imap_unordered(write_shard, tasks):
            entries.append(entry)
            records, written = records + entry["records"], written + disk_bytes(tasks[0][0], entry["file"])
            seconds = time.perf_counter() - started
            log(f"{label}: shard {already + len(entries)}/{shards} done, {records} records, "
                f"{written / 2**20:.1f} MB, {records / max(seconds, 1e-6):.0f} records/s")
    return entries


def disk_bytes(folder: str, shard: str) -> int:
    """What a shard and its index take on disk (a shard's reserved header and page ends are holes)."""
    return sum(os.stat(os.path.join(folder, name)).st_blocks * 512 for name in (shard, shard + ".db"))


def _replace(partial: str, output: str) -> None:
    """Rename the finished `partial` folder to `output`; an older conversion there goes last."""
    old = None
    if os.path.exists(output):
        old = f"{output.rstrip(os.sep)}.old.{os.getpid()}"
        os.rename(output, old)
    os.rename(partial, output)
    if old:
        shutil.rmtree(old)


def parse_args(argv: Optional[Sequence[str]]):
    parser = OneLineParser(prog="python -m src.data.mindrecord", description=__doc__.splitlines()[0])
    parser.add_argument("--data_path", required=True,
                        help="a dataset root (train/ and val/ or test/), a class folder, or CIFAR-10's binary files")
    parser.add_argument("--output", required=True, help="the shard folder (one sub-folder per split of a root)")
    parser.add_argument("--shards", type=int, default=None,
                        help="shards per split (default: about 256 MB each)")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="writer processes (default: the cores this process may use)")
    parser.add_argument("--overwrite", action="store_true", help="replace a finished conversion in --output")
    args = parser.parse_args(argv)
    if args.shards is not None and not 1 <= args.shards <= 1000:
        parser.error("--shards must be between 1 and 1000 (MindRecord's limit)")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    for split, source in find_splits(args.data_path):
        output = os.path.join(args.output, split) if split else args.output
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        try:
            convert_split(source, output, shards=args.shards, workers=args.workers, overwrite=args.overwrite,
                          log=lambda line: print(line, flush=True))
        except KeyboardInterrupt:
            print(f"interrupted: {output} is not written; the same command goes on from the shards already done",
                  file=sys.stderr, flush=True)
            return 130
    return 0


if __name__ == "__main__":
    run_cli(main)
