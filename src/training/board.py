"""The run's TensorBoard record, <run folder>/tensorboard/: scalars, the config as hyperparameters,
pictures and text tables.

Written with tensorboardX's summaries and event-file writer: a small, maintained writer of
TensorBoard's format that needs neither TensorFlow nor PyTorch (the one behind the `SummaryWriter`
PyTorch users know; its asynchronous queue is not used, see `Board`). The event files are read
back (to cut them for a resumed run) with the `tensorboard` package's own reader, the package that
serves the dashboard."""
import contextlib
import glob
import os
import sys
import time
from typing import Callable, Dict, Iterable, Mapping, Optional, Sequence

import numpy as np

from src.files import TMP_PREFIX, atomic_target, remove_stale_temporaries, write_failure

BOARD_FOLDER = "tensorboard"


def event_files(folder: str) -> list:
    """The event files in `folder`, oldest first (TensorBoard reads every file with 'tfevents' in its name)."""
    return sorted(glob.glob(os.path.join(folder, "*tfevents*")))


def _import_tensorboardx() -> None:
    """Import tensorboardX without PyTorch. Its package imports torch where torch is installed
    (1.9 s of every run's start here, beside PyTorch for the migration tools) to accept torch
    tensors in its SummaryWriter, which this module does not use; its summaries and event writer
    need only numpy. Where torch is already loaded, nothing changes."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        import tensorboardX  # noqa: F401
        return
    sys.modules["torch"] = None  # `import torch` raises ImportError: tensorboardX's "no torch here"
    try:
        import tensorboardX  # noqa: F401
    finally:
        del sys.modules["torch"]


def _event_records(path: str) -> Iterable[bytes]:
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    return RawEventFileLoader(path).Load()  # stops quietly at a record a killed run left half-written


def recorded_before_checkpoint(event, step: int) -> bool:
    """Whether `event` was written before the checkpoint at global `step`: every event of an earlier
    step, and the scalars of `step` itself (its training and evaluation rows). Its pictures and texts
    come after that checkpoint (the profiler's table, the run's end: the report's pictures and the
    session's end), and so does every later step."""
    if event.step != step:
        return event.step < step
    return all(value.HasField("simple_value") for value in event.summary.value)


def prune_events(folder: str, keep_through: Optional[int]) -> int:
    """Before a relaunch appends to `folder`: drop every event written after the checkpoint at step
    `keep_through` (all events when None, a run starting over), so what is done again (the steps
    trained again, the run's end) is not recorded twice.
    Each file is replaced through a temporary (without 'tfevents' in its name, so TensorBoard never
    reads it): a kill leaves every file whole, and pruning again changes nothing more. Returns the
    number of events dropped."""
    _import_tensorboardx()
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import RecordWriter

    dropped = 0
    for path in event_files(folder):
        if keep_through is None:
            os.remove(path)
            continue
        records = list(_event_records(path))
        kept = [record for record in records if recorded_before_checkpoint(Event.FromString(record), keep_through)]
        dropped += len(records) - len(kept)
        if len(kept) == len(records) and os.path.getsize(path) == _size_of(records):
            continue
        with atomic_target(path, tmp=os.path.join(folder, f"{TMP_PREFIX}{os.getpid()}-pruned")) as tmp:
            writer = RecordWriter(tmp)
            for record in kept:
                writer.write(record)
            writer.close()
    return dropped


def _size_of(records: list) -> int:
    return sum(len(record) + 16 for record in records)  # length, its checksum, the record, its checksum


def hparam_value(value):
    """A config value as TensorBoard's HParams plugin takes it (bool, number or string)."""
    if isinstance(value, (bool, int, float, str)):
        return value
    return "" if value is None else str(value)


class Board:
    """TensorBoard event files of one run, in `run_folder`/tensorboard/.

    A resumed run (`resume_step` = the checkpoint's step) first drops what the interrupted launch
    recorded after that checkpoint, and a run starting over (`resume_step` None) drops everything, so
    TensorBoard shows one continuous record. Events are written in the training's own thread and
    each call ends flushed to disk (a logged step's few events cost a write and an fsync): a
    TensorBoard watching the run sees every step as it is logged, a kill loses nothing a checkpoint
    covers, and a failed write (a full disk) is one WriteError naming the file instead of a writer
    thread that dies and blocks the run."""

    def __init__(self, run_folder: str, resume_step: Optional[int] = None):
        _import_tensorboardx()
        from tensorboardX.event_file_writer import EventsWriter

        self.folder = os.path.join(run_folder, BOARD_FOLDER)
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as err:
            raise write_failure(self.folder, err) from None
        remove_stale_temporaries(self.folder)
        prune_events(self.folder, resume_step)
        # the pid in the name: two launches in one second would otherwise share (and overwrite) a file
        self.events = self._guarded(lambda: EventsWriter(os.path.join(self.folder, "events"), f".{os.getpid()}"))
        self.path = self.events._file_name

    def _guarded(self, write: Callable):
        try:
            return write()
        except OSError as err:
            raise write_failure(getattr(self, "path", self.folder), err) from None

    def _write(self, summary, step: int) -> None:
        from tensorboardX.proto.event_pb2 import Event

        def write_and_flush() -> None:
            self.events.write_event(Event(wall_time=time.time(), step=step, summary=summary))
            self.events.flush()

        self._guarded(write_and_flush)

    def scalars(self, step: int, values: Mapping[str, Optional[float]]) -> None:
        from tensorboardX.proto.summary_pb2 import Summary

        self._write(Summary(value=[Summary.Value(tag=tag, simple_value=float(value))
                                   for tag, value in values.items() if value is not None]), step)

    def hyperparameters(self, config: Mapping[str, object], metrics: Iterable[str]) -> None:
        """The run's config as one row of the HParams table; its columns `metrics` are scalar tags
        whose last values TensorBoard shows beside the config."""
        from tensorboardX.summary import hparams

        experiment, start, _ = hparams({key: hparam_value(value) for key, value in config.items()},
                                       {tag: 0.0 for tag in metrics})
        self._write(experiment, 0)
        self._write(start, 0)

    def finished(self, step: int) -> None:
        """Mark the HParams session as ended (a run that stops early stays 'running' there)."""
        from tensorboardX.summary import hparams

        self._write(hparams({}, {})[2], step)

    def image(self, tag: str, pixels: np.ndarray, step: int) -> None:
        """An RGB uint8 picture [H, W, 3]."""
        from tensorboardX.summary import image

        self._write(image(tag, pixels, dataformats="HWC"), step)

    def picture_file(self, tag: str, path: str, step: int) -> None:
        """A PNG the run wrote (the report's pictures), as an image."""
        from PIL import Image

        with Image.open(path) as picture:
            self.image(tag, np.asarray(picture.convert("RGB")), step)

    def text(self, tag: str, markdown: str, step: int) -> None:
        from tensorboardX.summary import text

        self._write(text(tag, markdown), step)

    def close(self) -> None:
        """Close the file (every event is already on disk; a failure here loses nothing)."""
        with contextlib.suppress(OSError):
            self.events.close()


def scalar_tags(row: Dict[str, str]) -> Dict[str, float]:
    """A metrics.csv row as TensorBoard scalars: an evaluation row (it has top_1) under eval/, a
    training row under train/; empty columns and the step and epoch are left out."""
    section = "eval" if row.get("top_1") else "train"
    return {f"{section}/{column}": float(value) for column, value in row.items()
            if value not in ("", None) and column not in ("epoch", "step", "wall_time")}


TILE = 112  # each image of the batch picture, in pixels (CIFAR's 32 px scaled up 3.5x)
CAPTION_LINE = 12


def batch_picture(pixels: np.ndarray, captions: Sequence[str], columns: int = 8) -> np.ndarray:
    """A grid of RGB uint8 images [N, H, W, 3], each with its caption (its label) under it, as one
    RGB uint8 picture. Drawn with Pillow: a grid of matplotlib axes cost a second of every run's start."""
    from PIL import Image, ImageDraw

    lines = max(caption.count("\n") + 1 for caption in captions)
    cell_height = TILE + lines * CAPTION_LINE + 6
    rows = max(1, -(-len(pixels) // columns))
    canvas = Image.new("RGB", (columns * (TILE + 4), rows * cell_height), "white")
    draw = ImageDraw.Draw(canvas)
    for index, (image, caption) in enumerate(zip(pixels, captions)):
        left, top = (index % columns) * (TILE + 4) + 2, (index // columns) * cell_height + 2
        canvas.paste(Image.fromarray(np.ascontiguousarray(image)).resize((TILE, TILE), Image.NEAREST), (left, top))
        draw.multiline_text((left, top + TILE + 2), caption, fill="black", spacing=1)
    return np.asarray(canvas)


def target_captions(targets: np.ndarray, class_names: Sequence[str]) -> list:
    """Each sample's label: the class name, or for mixed soft targets the two largest shares."""
    if targets.ndim == 1:
        return [class_names[int(label)] for label in targets]
    captions = []
    for row in targets:
        first, second = np.argsort(-row)[:2]
        captions.append(class_names[first] if row[second] <= 1e-6 else
                        f"{class_names[first]} {row[first]:.2f}\n{class_names[second]} {row[second]:.2f}")
    return captions
