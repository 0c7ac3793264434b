"""MindRecord shards as `python -m src.data.mindrecord` writes them, and reading them back.

One split per folder (train/, val/): shards `part-00000-of-00008.mindrecord`, each with its `.db`
index, `classes.txt`, and `mindrecord.json` (the manifest, written last: a folder without it is no
finished conversion). Records are stored in the source's order, shard after shard, so record i of
the set is sample i of the source: MindSpore's C++ reader (MindDataset) given a SubsetSampler of
sample indices reads exactly the samples the keyed samplers ask for, in their order, and only
those. A record holds the image as stored (a file's bytes, or a CIFAR-10 record's raw pixels),
its label, its index and its path relative to the source folder.
"""
import json
import os
import struct
from typing import Dict, Iterator, List, Optional, Tuple

import mindspore.dataset as ds
import numpy as np

from src.data.bad_samples import UNREADABLE_ERRORS, reason_of
from src.data.batches import AugmentedSource, BatchAssembly, BatchKeys
from src.data.image_decode import crop_resize, image_from_bytes
from src.data.sources import IMAGE_EXTENSIONS
from src.errors import UserInputError

MANIFEST = "mindrecord.json"
CLASS_LIST = "classes.txt"
FORMAT = "resnet-mindrecord/1"
SCHEMA_NAME = "resnet_images"
SCHEMA = {"index": {"type": "int64"}, "label": {"type": "int32"}, "path": {"type": "string"},
          "image": {"type": "bytes"}}
ENCODED, PIXELS = "encoded", "pixels"  # what a record's image holds: a file's bytes, or raw HWC pixels
SUFFIX = ".mindrecord"
READ_WORKERS = 2  # the C++ reader's threads: file reads ahead of the batches being assembled
RECONVERT = "convert it again (python -m src.data.mindrecord)"


def shard_name(shard: int, count: int) -> str:
    return f"part-{shard:05d}-of-{count:05d}{SUFFIX}"


def read_header(path: str) -> Dict:
    """A MindRecord file's header (8 bytes of length, then JSON); {} when it is not one."""
    try:
        with open(path, "rb") as stream:
            head = stream.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            if not 0 < size < 1 << 26:
                return {}
            header = json.loads(stream.read(size))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return header if isinstance(header, dict) and "schema" in header else {}


def holds_shards(folder: str) -> bool:
    """Whether `folder` holds MindRecord shards (a manifest, or a file whose content is one)."""
    if os.path.isfile(os.path.join(folder, MANIFEST)):
        return True
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return False
    return any(entry.is_file() and not entry.name.endswith(".db") and not entry.name.lower().endswith(
        IMAGE_EXTENSIONS) and read_header(entry.path) for entry in entries[:64])


def shard_folder(data_path: str, split: str) -> Optional[str]:
    """The folder of `data_path`'s `split` (or `data_path` itself) when it holds shards, else None."""
    if not data_path:
        return None
    candidate = os.path.join(data_path, split)
    candidate = candidate if os.path.isdir(candidate) else data_path
    return candidate if os.path.isdir(candidate) and holds_shards(candidate) else None


def schema_of(header: Dict) -> Dict:
    schemas = header.get("schema") or [{}]
    return schemas[0].get("schema", {})


def records_in(header: Dict) -> int:
    """The record count a shard's header gives (its blob pages' row ranges; every record has a blob)."""
    return sum(page["end_row_id"] - page["start_row_id"] for page in header.get("page", [])
               if page.get("page_type") == "BLOB_DATA")


class MindRecordSource:
    """The samples of one converted split: `labels`, `class_names`, `len()`, `decode(data, index)`
    (a record's image as the class-folder or CIFAR source would load it), `read(indices)` (the
    records' images in that order, through MindDataset), `load`/`check` by index, and `paths`."""

    def __init__(self, folder: str, kind: str):
        self.root = folder
        manifest = read_manifest(folder)
        self.kind = manifest["kind"]
        if self.kind != kind:
            held = "CIFAR-10 pixels" if self.kind == PIXELS else "encoded images (class folders)"
            wanted = "--dataset cifar10" if self.kind == PIXELS else "--dataset imagenet2012 (or flower_photos)"
            raise UserInputError(f"{folder} holds {held}; use {wanted}")
        self.pixel_shape = tuple(manifest.get("pixel_shape") or ())
        self.files = [os.path.join(folder, shard["file"]) for shard in manifest["shards"]]
        self._shard_ends = np.cumsum([shard["records"] for shard in manifest["shards"]])
        self.labels = np.asarray(manifest["labels"], np.int32)
        self.class_names = read_class_list(folder, manifest)
        self._paths: Optional[List[str]] = None
        self._cursor, self._cursor_next = None, None

    def __len__(self) -> int:
        return len(self.labels)

    def name(self, index: int) -> str:
        """Where record `index` lies: its shard file and its place in the set."""
        shard = self.files[int(np.searchsorted(self._shard_ends, index, side="right"))]
        return f"{shard} (record {index} of the set)"

    def decode(self, data: bytes, index: int):
        """A record's image as the transforms take it: an opened image, or HWC uint8 pixels."""
        if self.kind == PIXELS:
            return np.frombuffer(data, np.uint8).reshape(self.pixel_shape)
        return image_from_bytes(data, f"record {index}")  # the caller's error names its shard

    def read(self, indices: np.ndarray, workers: int = READ_WORKERS) -> Iterator[Tuple[int, bytes]]:
        """(index, image bytes) of each of `indices`, in that order, read by MindSpore's C++ reader."""
        try:
            for start in range(0, len(indices), len(self)):  # a SubsetSampler takes at most the set's size
                chunk = [int(i) for i in indices[start:start + len(self)]]
                data = ds.MindDataset(self.files, columns_list=["index", "image"], num_parallel_workers=workers,
                                      sampler=ds.SubsetSampler(chunk))
                for index, image in data.create_tuple_iterator(num_epochs=1, output_numpy=True):
                    yield int(index), image.tobytes()
        except RuntimeError as err:
            raise UserInputError(f"cannot read the MindRecord shards in {self.root} ({mindspore_reason(err)}); "
                                 f"{RECONVERT}") from None

    def load(self, index: int):
        """One record's image, for checks (training reads whole batches: RecordBatches). Indices
        asked in a row share one reader, which goes on to the end of the set."""
        if self._cursor is None or self._cursor_next != index:
            self._cursor = self.read(np.arange(index, len(self)), workers=1)
        self._cursor_next = index + 1
        _, data = next(self._cursor)
        return self.decode(data, index)

    def check(self, index: int) -> None:
        image = self.load(index)
        if self.kind == ENCODED:
            crop_resize(image, (0, 0, image.width, image.height), image.size, mode="plain")

    @property
    def paths(self) -> List[str]:
        """Each record's file, relative to the converted folder (read once, for reports)."""
        if self._paths is None:
            data = ds.MindDataset(self.files, columns_list=["path"], shuffle=False, num_parallel_workers=1)
            self._paths = [str(path) for path, in data.create_tuple_iterator(num_epochs=1, output_numpy=True)]
        return self._paths

    def __getstate__(self):
        return {**self.__dict__, "_paths": None, "_cursor": None, "_cursor_next": None}


def mindspore_reason(err: BaseException) -> str:
    """The line of a MindSpore error that says what went wrong (its text is a report of many lines)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip() and not line.startswith("-")]
    return next((line for line in lines if "ERROR" in line or "Invalid" in line), lines[0] if lines else "")


def read_manifest(folder: str) -> Dict:
    """The manifest of a converted split, checked against the files beside it: every shard and its
    `.db` present, each as long as written, each header this repository's schema."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        for name in sorted(os.listdir(folder)):
            fields = schema_of(read_header(os.path.join(folder, name)))
            if fields and fields != SCHEMA:
                raise UserInputError(f"{os.path.join(folder, name)} is MindRecord with another tool's schema "
                                     f"(fields {sorted(fields)}); convert the source images with "
                                     f"python -m src.data.mindrecord")
        raise UserInputError(f"{folder} holds MindRecord shards but no {MANIFEST}: the conversion did not "
                             f"finish; run python -m src.data.mindrecord again")
    try:
        with open(path) as stream:
            manifest = json.load(stream)
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, expected {FORMAT!r}")
        shards, labels = manifest["shards"], manifest["labels"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserInputError(f"{path} is not a manifest this repository wrote ({err}); {RECONVERT}") from None
    for shard in shards:
        _check_shard(folder, shard)
    if sum(shard["records"] for shard in shards) != len(labels):
        raise UserInputError(f"{path} lists {len(labels)} labels for "
                             f"{sum(shard['records'] for shard in shards)} records; {RECONVERT}")
    return manifest


def _check_shard(folder: str, shard: Dict) -> None:
    path = os.path.join(folder, shard["file"])
    if not os.path.isfile(path):
        raise UserInputError(f"shard {path} is missing ({MANIFEST} lists it); copy the whole folder again")
    if not os.path.isfile(path + ".db"):
        raise UserInputError(f"index file {path}.db is missing (each shard needs its .db beside it); "
                             f"copy the whole folder again")
    size = os.path.getsize(path)
    if size != shard["bytes"]:
        raise UserInputError(f"shard {path} has {size} bytes, {shard['bytes']} were written (truncated or "
                             f"damaged in a copy); copy the folder again or {RECONVERT}")
    header = read_header(path)
    if schema_of(header) != SCHEMA or records_in(header) != shard["records"]:
        raise UserInputError(f"shard {path} is not the one {MANIFEST} lists (schema or record count differs); "
                             f"{RECONVERT}")


def read_class_list(folder: str, manifest: Dict) -> List[str]:
    """classes.txt, checked against the records: one name per label, as the conversion wrote them."""
    path = os.path.join(folder, CLASS_LIST)
    try:
        with open(path) as stream:
            names = [line.rstrip("\n") for line in stream if line.strip()]
    except OSError:
        raise UserInputError(f"class list {path} is missing; {RECONVERT}") from None
    labels = manifest["labels"]
    if names != manifest.get("class_names") or (labels and max(labels) >= len(names)):
        raise UserInputError(f"class list {path} ({len(names)} names) disagrees with the records "
                             f"({len(manifest.get('class_names', []))} classes written, largest label "
                             f"{max(labels) if labels else '-'}); restore it or {RECONVERT}")
    return names


class RecordBatches:
    """A batch's raw records by batch number, read in order through one MindDataset per epoch (a
    random batch number restarts the reader there): (keys int64 [B], the records' images back to
    back uint8, their ends int64 [B]). RecordAssembly turns them into the batch a class folder's
    BatchSource gives for the same keys."""

    def __init__(self, source: MindRecordSource, keys: BatchKeys):
        self.source, self.keys = source, keys
        self._records, self._next = None, None

    def __len__(self) -> int:
        return self.keys.batches_per_epoch

    def _open(self, number: int) -> Iterator[Tuple[int, bytes]]:
        epoch, position = divmod(number, self.keys.batches_per_epoch)
        batch = self.keys.batch_size
        keys = self.keys.epoch_keys(epoch)[position * batch:self.keys.batches_per_epoch * batch]
        return self.source.read(keys % len(self.source))

    def __getitem__(self, number: int):
        number = int(number)
        keys = self.keys(number)
        if number != self._next or number % self.keys.batches_per_epoch == 0:  # each epoch reads anew
            self._records = self._open(number)
        self._next = number + 1
        images, ends = [], np.empty(len(keys), np.int64)
        total = len(self.source)
        for slot, key in enumerate(keys):
            index, image = next(self._records)
            if index != key % total:
                raise UserInputError(f"the shards in {self.source.root} gave record {index} where sample "
                                     f"{key % total} belongs; {RECONVERT}")
            images.append(image)
            ends[slot] = (ends[slot - 1] if slot else 0) + len(image)
        return keys.astype(np.int64), np.frombuffer(b"".join(images), np.uint8), ends

    def __getstate__(self):
        return {**self.__dict__, "_records": None, "_next": None}


class RecordAssembly:
    """The map operation after RecordBatches: decodes and augments each record by its key, exactly
    as BatchSource does for a class folder's files."""

    def __init__(self, samples: AugmentedSource, assembly: BatchAssembly):
        self.samples, self.assembly = samples, assembly

    def __call__(self, keys: np.ndarray, images: np.ndarray, ends: np.ndarray):
        source = self.samples.source
        starts = np.concatenate(([0], ends[:-1]))

        def fill(slot: int, key: int, out: np.ndarray):
            index = key % len(source)
            try:
                raw = source.decode(images[starts[slot]:ends[slot]].tobytes(), index)
                return self.samples.augment(key, raw, source.labels[index], out)
            except UNREADABLE_ERRORS as err:
                if self.samples.bad_samples is None:
                    raise UserInputError(f"cannot decode {source.name(index)}: {reason_of(err)}; copy the shard "
                                         f"again, or replace the source image and {RECONVERT}") from None
                # As a class folder's unreadable file: counted, listed, bounded by max_bad_samples,
                # and replaced by the next readable record (read on its own).
                self.samples.record_unreadable(key, index, err)
                return self.samples.fill(key, out)

        return self.assembly(keys, fill)
