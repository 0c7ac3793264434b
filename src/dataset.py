"""One dataset factory for CIFAR-10 binary files and ImageNet-style class folders.

Data workers build whole batches of uint8 RGB pixels (one hand-over per batch, 4x fewer bytes than
float32); the network's first cell normalizes them and applies erasing and mixing
(src/data/input_stage.py). The pipeline's randomness (sample order and augmentation) is a pure
function of (seed, epoch, sample index): an `EpochSampler` hands out keys `(epoch * ra_reps +
repeat) * N + index`, and the source derives each sample's crop, flip, policy and erasing box from
that key; batch mixing draws from a generator keyed by the batch's first key. So a run resumed at
epoch k sees exactly the data an uninterrupted run would, whatever the number or kind of workers.
Sharding is done here too: eval shards split the samples exactly (nothing dropped or
repeated); training shards are equal-sized slices of the epoch's permutation.
"""
import glob
import math
import os
import threading
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import cv2
import mindspore.dataset as ds
import mindspore.dataset.vision as vision
import numpy as np
from PIL import Image

from src.data.auto_augment import create_policy, interpolation_mode
from src.data.bad_samples import UNREADABLE_ERRORS, BadSampleLog, bad_sample_limit, reason_of, sample_name
from src.data.batch_mixing import check_mixing, draw_mix
from src.data.host_stage import (  # noqa: F401 (statistics and normalization re-exported for callers of this face)
    CIFAR_MEAN,
    CIFAR_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    NO_MIX,
    host_normalize,
    normalization_of,
)
from src.data.image_decode import crop_resize, open_image
from src.data.input_stage import TrainInputStage
from src.data.random_erasing import erase_box
from src.deploy.inference import read_class_names
from src.device import worker_budget
from src.errors import UserInputError

DATASETS = ("cifar10", "imagenet2012", "flower_photos")
# Class-folder datasets: the sub-folder each evaluates on (the model zoo's flower_photos has train/ and test/).
EVAL_FOLDERS = {"imagenet2012": "val", "flower_photos": "test"}
CIFAR_SIDE = 32
CIFAR_RECORD_BYTES = 1 + CIFAR_SIDE * CIFAR_SIDE * 3
# CIFAR-10's labels 0..9 (batches.meta.txt of the binary release), for a folder without that file
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
EVAL_CROP_RATIO = 0.875  # resize to 256 then center-crop 224
PIL_INTERPOLATIONS = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC, "nearest": Image.NEAREST}
MIXING_STREAM = 1  # keeps the batch generator apart from the per-sample ones


@dataclass(frozen=True)
class Augmentation:
    """The training data recipe beyond crop and flip (config keys of the same names)."""
    auto_augment: str = "none"     # none | imagenet | cifar10 | svhn | ra | ta_wide | augmix
    ra_num_ops: int = 2
    ra_magnitude: int = 9
    augmix_severity: int = 3
    random_erase: float = 0.0      # probability
    mixup_alpha: float = 0.0       # 0: off
    cutmix_alpha: float = 0.0      # 0: off
    ra_reps: int = 1               # repeated augmentation: copies of each sample per epoch

    @property
    def mixes(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    @property
    def needs_batch_stage(self) -> bool:
        """Erasing and mixing act on the normalized batch."""
        return self.random_erase > 0 or self.mixes

    def check(self) -> None:
        """One-line errors naming the key for values out of range."""
        create_policy(self.auto_augment, num_ops=self.ra_num_ops, magnitude=self.ra_magnitude,
                      severity=self.augmix_severity)
        if not 0.0 <= self.random_erase <= 1.0:
            raise UserInputError(f"random_erase is a probability in [0, 1], got {self.random_erase}")
        check_mixing(self.mixup_alpha, self.cutmix_alpha)
        if self.ra_reps < 1:
            raise UserInputError(f"ra_reps must be >= 1 (1 turns repeated augmentation off), got {self.ra_reps}")


PLAIN = Augmentation()


class CifarBinarySource:
    """Images and labels from CIFAR-10 binary files (any record count)."""

    def __init__(self, data_path: str, training: bool):
        folder = _cifar_folder(data_path)
        pattern = "data_batch_*.bin" if training else "test_batch.bin"
        files = sorted(glob.glob(os.path.join(folder, pattern)))
        if not files:
            wanted = "data_batch_1.bin ... data_batch_5.bin" if training else "test_batch.bin"
            raise UserInputError(f"no CIFAR-10 {'training' if training else 'test'} file ({wanted}) in "
                                 f"{folder}; point data_path at the folder cifar-10-batches-bin")
        records = [self._read(path) for path in files]
        data = np.concatenate(records)
        self.labels = data[:, 0].astype(np.int32)
        self.images = data[:, 1:].reshape(-1, 3, CIFAR_SIDE, CIFAR_SIDE).transpose(0, 2, 3, 1)
        self.images = np.ascontiguousarray(self.images)
        meta = os.path.join(folder, "batches.meta.txt")
        self.class_names = read_class_names(meta) if os.path.isfile(meta) else list(CIFAR10_CLASSES)

    @staticmethod
    def _read(path: str) -> np.ndarray:
        size = os.path.getsize(path)
        if size == 0 or size % CIFAR_RECORD_BYTES:
            raise UserInputError(f"{path} is not a CIFAR-10 binary file: {size} bytes is not a whole "
                                 f"number of {CIFAR_RECORD_BYTES}-byte records; re-extract the dataset")
        return np.fromfile(path, dtype=np.uint8).reshape(-1, CIFAR_RECORD_BYTES)

    def __len__(self) -> int:
        return len(self.labels)

    def load(self, index: int) -> np.ndarray:
        return self.images[index]

    def check(self, index: int) -> None:
        """Records are raw pixels: nothing to decode."""


def _cifar_folder(data_path: str) -> str:
    _require_folder(data_path)
    nested = os.path.join(data_path, "cifar-10-batches-bin")
    return nested if os.path.isdir(nested) else data_path


class ImageFolderSource:
    """Images in one sub-folder per class (sorted folder names give the labels)."""

    def __init__(self, data_path: str, training: bool, eval_folder: str = "val"):
        _require_folder(data_path)
        split = os.path.join(data_path, "train" if training else eval_folder)
        if not training and not os.path.isdir(split) and os.path.isdir(os.path.join(data_path, "train")):
            raise UserInputError(f"{data_path} has train/ but no {eval_folder}/ folder to evaluate on; pass the "
                                 f"validation folder (--eval_dataset_path, or DATASET_PATH for run_eval.sh)")
        self.root = split if os.path.isdir(split) else data_path
        self.class_names = sorted(entry.name for entry in os.scandir(self.root) if entry.is_dir())
        if not self.class_names:
            raise UserInputError(f"no class sub-folders in {self.root}; expected "
                                 f"{self.root}/<class name>/<image>.jpg")
        self.paths: List[str] = []
        labels = []
        for label, name in enumerate(self.class_names):
            folder = os.path.join(self.root, name)
            files = sorted(f for f in os.listdir(folder) if f.lower().endswith(IMAGE_EXTENSIONS))
            self.paths += [os.path.join(folder, f) for f in files]
            labels += [label] * len(files)
        if not self.paths:
            raise UserInputError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) in the class folders of "
                                 f"{self.root}")
        self.labels = np.asarray(labels, dtype=np.int32)

    def __len__(self) -> int:
        return len(self.paths)

    def load(self, index: int):
        """The image, read but not decoded: the transform decodes only what its crop needs."""
        return open_image(self.paths[index])

    def check(self, index: int) -> None:
        """Read and decode the whole image (UnreadableImageError names the file where it fails)."""
        image = self.load(index)
        crop_resize(image, (0, 0, image.width, image.height), image.size, mode="plain")


def _require_folder(path: str) -> None:
    if not path:
        raise UserInputError("data_path is empty; pass --data_path /path/to/dataset")
    if not os.path.isdir(path):
        raise UserInputError(f"dataset folder not found: {path}; pass --data_path with an existing folder")


def random_crop_flip(image: np.ndarray, rng: np.random.Generator, padding: int = 4) -> np.ndarray:
    """CIFAR augmentation: zero-pad, crop back to the original size at random, flip half the time
    (a view of a per-thread padded buffer: copy it before the next call)."""
    height, width = image.shape[:2]
    padded = _padded_buffer(height + 2 * padding, width + 2 * padding, image.shape[2])
    padded[padding:padding + height, padding:padding + width] = image  # the border stays zero
    top, left = rng.integers(0, 2 * padding + 1, size=2)
    out = padded[top:top + height, left:left + width]
    return out[:, ::-1] if rng.random() < 0.5 else out


class _PaddedBuffers(threading.local):
    def __init__(self):
        self.by_shape = {}


_padded = _PaddedBuffers()


def _padded_buffer(height: int, width: int, channels: int) -> np.ndarray:
    """A zeroed buffer per thread and shape, reused (np.pad allocates and fills one per call)."""
    shape = (height, width, channels)
    if shape not in _padded.by_shape:
        _padded.by_shape[shape] = np.zeros(shape, np.uint8)
    return _padded.by_shape[shape]


def random_resized_crop_box(width: int, height: int, rng: np.random.Generator,
                            scale: Tuple[float, float] = (0.08, 1.0),
                            ratio: Tuple[float, float] = (3 / 4, 4 / 3)) -> Tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box (left, top, width, height), falling back to a center crop."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        crop_w = int(round(math.sqrt(target_area * aspect)))
        crop_h = int(round(math.sqrt(target_area / aspect)))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            left = int(rng.integers(0, width - crop_w + 1))
            top = int(rng.integers(0, height - crop_h + 1))
            return left, top, crop_w, crop_h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        crop_w, crop_h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        crop_w, crop_h = int(round(height * ratio[1])), height
    else:
        crop_w, crop_h = width, height
    return (width - crop_w) // 2, (height - crop_h) // 2, crop_w, crop_h


def pil_interpolation(name: str) -> int:
    interpolation_mode(name)  # the one check of the name
    return PIL_INTERPOLATIONS[name]


def eval_resize_side(image_size: int, resize_size: int = 0) -> int:
    """The short side evaluation resizes to: `resize_size`, or image_size / 0.875 when 0."""
    return resize_size or int(round(image_size / EVAL_CROP_RATIO))


def folder_train_transform(image, size: int, rng: np.random.Generator, interpolation: str = "bilinear",
                           antialias: bool = True, out: Optional[np.ndarray] = None) -> np.ndarray:
    """ImageNet augmentation: random resized crop to size x size, flip half the time. The resize
    antialiases as Pillow does (bilinear: OpenCV's approximation of it) or, without `antialias`,
    samples as the model zoo's native pipeline does (src/data/image_decode.py RESIZE_MODES).
    Written into `out` when given."""
    left, top, crop_w, crop_h = random_resized_crop_box(image.width, image.height, rng)
    array = crop_resize(image, (left, top, left + crop_w, top + crop_h), (size, size), pil_interpolation(interpolation),
                        mode="fast" if antialias else "plain", out=out)
    return cv2.flip(array, 1, dst=array) if rng.random() < 0.5 else array


def folder_eval_transform(image, size: int, resize_size: int = 0,
                          interpolation: str = "bilinear") -> np.ndarray:
    """Resize the short side to `resize_size` (default size / 0.875: 256 for 224), then center-crop
    size x size."""
    short = eval_resize_side(size, resize_size)
    scale = short / min(image.width, image.height)
    resized_w, resized_h = max(size, round(image.width * scale)), max(size, round(image.height * scale))
    left, top = (resized_w - size) // 2, (resized_h - size) // 2
    # The crop's box in the original image: resizing only it gives the pixels of resize-then-crop.
    scale_x, scale_y = resized_w / image.width, resized_h / image.height
    box = (left / scale_x, top / scale_y, (left + size) / scale_x, (top + size) / scale_y)
    return crop_resize(image, box, (size, size), pil_interpolation(interpolation))


class AugmentedSource:
    """Random-access source over sample keys (index = key % N); augmentation seeded by (seed, key).

    Draws come in a fixed order from the sample's generator: crop and flip, then the policy, then
    the erasing box. `fill` writes a sample's uint8 HWC image into a batch slot and returns its
    label and, with `batch_stage`, its erase box.
    With a `bad_samples` log, an unreadable sample (failing at open or at decode) is recorded and
    replaced by the next readable index, augmented as the key says: the replacement depends on the
    key alone, so resume stays exact. Without one, it is an error naming the file."""

    def __init__(self, source, transform: Callable, augment: bool, seed: int, *,
                 policy: Optional[Callable] = None, erase_probability: float = 0.0, image_size: int = 0,
                 batch_stage: bool = False,
                 bad_samples: Optional[BadSampleLog] = None, keys_per_epoch: int = 0):
        self.source = source
        self.transform = transform
        self.augment = augment
        self.seed = seed
        self.policy = policy
        self.erase_probability, self.image_size = erase_probability, image_size
        self.batch_stage = batch_stage
        self.bad_samples = bad_samples
        self.keys_per_epoch = keys_per_epoch or len(source)
        self.known_bad = set()

    def __len__(self) -> int:
        return len(self.source)

    def _sample(self, key: int, index: int, out: np.ndarray):
        rng = sample_generator(self.seed, key) if self.augment else None
        image = self.transform(self.source.load(index), rng, out)
        if self.policy is not None and rng is not None:
            image = self.policy(np.ascontiguousarray(image), rng)
        if image is not out:
            out[...] = image
        label = self.source.labels[index]
        if not self.batch_stage:
            return label, None
        return label, erase_box(self.image_size, self.image_size, rng, self.erase_probability)

    def fill(self, key: int, out: np.ndarray):
        """Write the sample of `key` into `out` (uint8, image_size x image_size x 3); returns its
        label and, with `batch_stage`, its erase box (else None)."""
        key = int(key)
        total = len(self.source)
        first = key % total
        for index in (i % total for i in range(first, first + total)):
            if index in self.known_bad:
                continue
            try:
                return self._sample(key, index, out)
            except UNREADABLE_ERRORS as err:
                if self.bad_samples is None:
                    raise UserInputError(f"cannot read {sample_name(self.source, index)} ({reason_of(err)}); "
                                         f"remove or replace the file") from None
                self.known_bad.add(index)
                self.bad_samples.add(key // self.keys_per_epoch, index, sample_name(self.source, index),
                                     reason_of(err))
        raise UserInputError("no readable sample in the dataset; check the image files")

    def __getitem__(self, key: int):
        """(image, label[, erase box]) of `key`, the image in a buffer of its own."""
        image = np.empty((self.image_size, self.image_size, 3), np.uint8)
        label, box = self.fill(key, image)
        return (image, label) if box is None else (image, label, box)


def sample_generator(seed: int, key: int) -> np.random.Generator:
    """The generator of one sample's draws: Philox keyed by (seed, key), its streams independent
    across keys. One generator per thread is re-keyed for each sample (5x cheaper than building
    one), so use it before the next call in the same thread."""
    generator = _generators.philox
    generator.bit_generator.state = {"bit_generator": "Philox",
                                     "state": {"counter": np.zeros(4, np.uint64),
                                               "key": np.array([seed & _WORD, key], np.uint64)},
                                     "buffer": np.zeros(4, np.uint64), "buffer_pos": 4, "has_uint32": 0,
                                     "uinteger": 0}
    return generator


class _Generators(threading.local):
    def __init__(self):
        self.philox = np.random.Generator(np.random.Philox(key=0))


_generators = _Generators()
_WORD = (1 << 64) - 1  # Philox keys are unsigned 64-bit words


class BatchSource:
    """Whole batches by batch number (`epoch * batches_per_epoch + position`), so a worker hands
    over one batch at a time: uint8 NHWC images and int32 labels, plus, for the training recipe's
    batch stage, each sample's erase box (int32 [B, 4]) and the batch's mixing (float32 [8],
    src/data/input_stage.py MIX_FIELDS) drawn from a generator keyed by (seed, the batch's first
    key). The batch's keys come from `sampler.epoch_keys`, so any worker computes any batch."""

    def __init__(self, samples: AugmentedSource, sampler: "EpochSampler", batch_size: int, batches_per_epoch: int,
                 *, augmentation: "Augmentation", batch_stage: bool, seed: int):
        self.samples, self.sampler = samples, sampler
        self.batch_size, self.batches_per_epoch = batch_size, batches_per_epoch
        self.augmentation, self.batch_stage, self.seed = augmentation, batch_stage, seed
        self._epoch, self._keys = None, None
        self._process = None

    def __len__(self) -> int:
        return self.batches_per_epoch

    def batch_keys(self, number: int) -> np.ndarray:
        """The sample keys of batch `number`."""
        epoch, position = divmod(number, self.batches_per_epoch)
        if epoch != self._epoch:
            self._epoch, self._keys = epoch, self.sampler.epoch_keys(epoch)[self.sampler.skip:]
        return self._keys[position * self.batch_size:(position + 1) * self.batch_size]

    def __getitem__(self, number: int):
        if self._process != os.getpid():
            # Each worker is one thread of work: OpenCV's own threads would only oversubscribe
            # the cores the other workers and the training process use.
            cv2.setNumThreads(1)
            self._process = os.getpid()
        keys = self.batch_keys(int(number))
        size = self.samples.image_size
        images = np.empty((len(keys), size, size, 3), np.uint8)
        labels = np.empty(len(keys), np.int32)
        boxes = np.empty((len(keys), 4), np.int32)
        for slot, key in enumerate(keys):
            labels[slot], box = self.samples.fill(key, images[slot])
            if box is not None:
                boxes[slot] = box
        if not self.batch_stage:
            return images, labels
        mix = NO_MIX.copy()
        if self.augmentation.mixes:
            rng = np.random.default_rng([self.seed, MIXING_STREAM, int(keys[0])])
            mix = draw_mix(rng, size, size, mixup_alpha=self.augmentation.mixup_alpha,
                           cutmix_alpha=self.augmentation.cutmix_alpha)
        return images, labels, boxes, mix


class BatchSampler(ds.Sampler):
    """Batch numbers for a BatchSource; each call to iter() is the next epoch of `sampler`."""

    def __init__(self, sampler: "EpochSampler", batch_size: int, drop_remainder: bool):
        self.sampler = sampler
        samples = len(sampler)
        self.batches_per_epoch = samples // batch_size if drop_remainder else -(-samples // batch_size)
        super().__init__()  # reads len(self)

    def __iter__(self):
        epoch = self.sampler.epoch
        self.sampler.epoch += 1
        yield from range(epoch * self.batches_per_epoch, (epoch + 1) * self.batches_per_epoch)

    def __len__(self) -> int:
        return self.batches_per_epoch


class EpochSampler(ds.Sampler):
    """Yields sample keys `(epoch * repeats + repeat) * N + index` for this shard; each call to
    iter() is the next epoch.

    Training: the epoch's permutation (seeded by seed and epoch), cut into equal shards. With
    `repeats` > 1 (repeated augmentation), each index of the permutation stands `repeats` times in
    a row and the shards take every `num_shards`-th entry, so the copies of a sample land on
    different ranks with different keys; each shard keeps N / num_shards entries, so an epoch is as
    long as without repeats. Evaluation: every sample exactly once across shards, in order.
    `skip` leaves out the first samples of each epoch: a one-epoch dataset with it is the rest
    of an epoch interrupted after `skip` samples (MindSpore needs every epoch of a dataset to have
    the same length, so a mid-epoch resume trains that rest as a dataset of its own)."""

    def __init__(self, num_samples: int, *, training: bool, shuffle: bool, num_shards: int,
                 shard_id: int, seed: int, start_epoch: int = 0, repeats: int = 1,
                 skip: int = 0):
        self.total = num_samples
        self.training = training
        self.shuffle = shuffle
        self.num_shards = num_shards
        self.shard_id = shard_id
        self.seed = seed
        self.epoch = start_epoch
        self.repeats = repeats if training else 1
        self.skip = skip
        super().__init__()  # reads len(self)

    def epoch_keys(self, epoch: int) -> np.ndarray:
        """The sample keys this shard reads in `epoch`."""
        order = np.arange(self.total)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.total)
        positions = np.arange(self.shard_id, self.total * self.repeats, self.num_shards)
        if self.training:
            positions = positions[:self.total // self.num_shards]
        index, repeat = order[positions // self.repeats], positions % self.repeats
        return (epoch * self.repeats + repeat) * self.total + index

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """The sample indices this shard reads in `epoch`."""
        return self.epoch_keys(epoch) % self.total

    def __iter__(self):
        epoch = self.epoch
        self.epoch += 1
        for key in self.epoch_keys(epoch)[self.skip:]:
            yield int(key)

    def __len__(self) -> int:
        if self.training:
            return self.total // self.num_shards - self.skip
        return len(range(self.shard_id, self.total, self.num_shards)) - self.skip


def _transform(dataset: str, image_size: int, resize_size: int = 0, interpolation: str = "bilinear",
               antialias: bool = True) -> Callable:
    """The per-sample (Python) transform of `dataset` to a uint8 HWC image of image_size x
    image_size (possibly written into `out`); it gets rng=None when augmentation is off."""
    if dataset == "cifar10":
        def transform(image, rng, out=None):
            return fit_size(image if rng is None else random_crop_flip(image, rng), image_size, interpolation)
        return transform

    def transform(image, rng, out=None):
        if rng is None:
            return folder_eval_transform(image, image_size, resize_size, interpolation)
        return folder_train_transform(image, image_size, rng, interpolation, antialias, out=out)
    return transform


def fit_size(image: np.ndarray, image_size: int, interpolation: str = "bilinear") -> np.ndarray:
    """An RGB uint8 HWC image resized to image_size x image_size where it has another size (CIFAR
    at a network size other than 32; folder transforms already give that size)."""
    if image.shape[:2] != (image_size, image_size):
        resize = vision.Resize((image_size, image_size), interpolation_mode(interpolation))
        return resize(np.ascontiguousarray(image))
    return image


def eval_image(image: Image.Image, dataset: str, image_size: int, resize_size: int = 0,
               interpolation: str = "bilinear") -> np.ndarray:
    """One image as evaluation crops it, before normalization: RGB uint8 HWC, what the dataset's
    evaluation batches hold (for prediction; host_normalize gives a float model's input).

    The steps of `create_dataset(..., training=False)`, with the same operations: 'imagenet2012'
    applies the eval transform (short side to `resize_size`, default image_size / 0.875, center
    crop); 'cifar10' resizes to image_size x image_size unless the image already has that size
    (CIFAR evaluates without a crop)."""
    if dataset not in DATASETS:
        raise UserInputError(f"unknown dataset '{dataset}'; choose one of {', '.join(DATASETS)}")
    image = image.convert("RGB")
    if dataset == "cifar10":
        return fit_size(np.asarray(image), image_size, interpolation)
    return _transform(dataset, image_size, resize_size, interpolation)(image, None)


WORKER_KINDS = ("process", "thread")


def _source_workers(num_parallel_workers: int, worker_kind: str) -> dict:
    """How the batch source runs: one worker is a thread of the training process; more are
    worker processes (or threads: JPEG decoding and OpenCV release the GIL, the Python glue
    around them does not). Batches are the same either way: they depend on their keys only."""
    if worker_kind not in WORKER_KINDS:
        raise UserInputError(f"unknown data_worker_kind '{worker_kind}'; choose one of {', '.join(WORKER_KINDS)}")
    if num_parallel_workers <= 1:
        return {"num_parallel_workers": 1, "python_multiprocessing": False}
    return {"num_parallel_workers": num_parallel_workers, "python_multiprocessing": worker_kind == "process"}


def create_source(dataset: str, data_path: str, training: bool):
    """The raw sample source for `dataset` ('cifar10' binary files, 'imagenet2012' or 'flower_photos'
    class folders)."""
    if dataset == "cifar10":
        return CifarBinarySource(data_path, training)
    if dataset in EVAL_FOLDERS:
        return ImageFolderSource(data_path, training, eval_folder=EVAL_FOLDERS[dataset])
    raise UserInputError(f"unknown dataset '{dataset}'; choose one of {', '.join(DATASETS)}")


def create_dataset(dataset: str, data_path: str, *, training: bool, batch_size: int, image_size: int,
                   class_num: Optional[int] = None, num_parallel_workers: int = 2, worker_kind: str = "process",
                   num_shards: int = 1, shard_id: int = 0, seed: int = 1, start_epoch: int = 0,
                   shuffle: Optional[bool] = None, augment: Optional[bool] = None,
                   augmentation: Augmentation = PLAIN, interpolation: str = "bilinear",
                   resize_size: int = 0, antialias: bool = True, bad_sample_file: Optional[str] = None,
                   max_bad_samples: int = -1,
                   skip_samples: int = 0) -> ds.Dataset:
    """A dataset of whole batches: (images uint8 [B, H, W, 3] RGB, labels int32 [B]), plus (erase
    boxes int32 [B, 4], mix float32 [8]) when `augmentation` erases or mixes. The network's first
    cell turns them into its input (src/data/input_stage.py; `data.normalization` says with which
    statistics).

    Training drops the last partial batch; evaluation keeps every sample exactly once.
    `shuffle` and `augment` default to `training`; `augmentation` (the recipe beyond crop and flip)
    applies only where `augment` is on. `num_parallel_workers` workers build whole batches, as
    processes or threads (`worker_kind`); the batches do not depend on either.
    `interpolation` (bilinear, bicubic, nearest) drives every resize and geometric operation;
    `resize_size` is evaluation's short side (0: image_size / 0.875); `antialias` off resizes
    training crops without antialiasing (the model zoo's way, faster).
    With `bad_sample_file`, unreadable samples are recorded there and replaced, up to
    `max_bad_samples` distinct files (-1: 0.1% of the dataset); the log is `data.bad_samples`.
    `skip_samples` leaves out the first samples of every epoch (for the rest of an interrupted
    epoch; see EpochSampler)."""
    augment = training if augment is None else augment
    augmentation = augmentation if augment else PLAIN
    augmentation.check()
    policy = create_policy(augmentation.auto_augment, num_ops=augmentation.ra_num_ops,
                           magnitude=augmentation.ra_magnitude, severity=augmentation.augmix_severity,
                           interpolation=interpolation)
    if augmentation.mixes and class_num is None:
        raise UserInputError("mixup/cutmix need class_num for their soft targets; set --class_num")
    workers = _source_workers(worker_budget(num_parallel_workers), worker_kind)  # entry points cap (and log) per rank
    source = create_source(dataset, data_path, training)
    if class_num is not None and source.labels.max() >= class_num:
        raise UserInputError(f"{data_path} has label {int(source.labels.max())} but class_num is "
                             f"{class_num}; set --class_num to the number of classes")
    shuffle = training if shuffle is None else shuffle
    sampler = EpochSampler(len(source), training=training, shuffle=shuffle, num_shards=num_shards,
                           shard_id=shard_id, seed=seed, start_epoch=start_epoch, repeats=augmentation.ra_reps,
                           skip=skip_samples)
    if len(sampler) == 0 or (training and len(sampler) < batch_size):
        raise UserInputError(f"{data_path} gives {len(sampler)} samples to this shard, fewer than one "
                             f"batch of {batch_size}; lower batch_size or add data")
    batch_stage = augmentation.needs_batch_stage
    bad_samples = None
    if bad_sample_file:
        bad_samples = BadSampleLog(bad_sample_file, bad_sample_limit(max_bad_samples, len(source)))
    samples = AugmentedSource(source, _transform(dataset, image_size, resize_size, interpolation, antialias),
                              augment, seed, policy=policy, image_size=image_size,
                              erase_probability=augmentation.random_erase, batch_stage=batch_stage,
                              bad_samples=bad_samples, keys_per_epoch=len(source) * sampler.repeats)
    batches = BatchSampler(sampler, batch_size, drop_remainder=training)
    columns = ["image", "label"] + (["erase", "mix"] if batch_stage else [])
    if workers["python_multiprocessing"]:
        # The workers are forked from this process. Forked while OpenCV's thread pool has threads,
        # a worker inherits a pool it cannot stop: its first cv2.setNumThreads(1) hangs for good
        # (seen when earlier OpenCV work ran in this process). So this process's OpenCV runs on one
        # thread from here on, as every worker's does.
        cv2.setNumThreads(1)
    data = ds.GeneratorDataset(BatchSource(samples, sampler, batch_size, batches.batches_per_epoch,
                                           augmentation=augmentation, batch_stage=batch_stage, seed=seed),
                               columns, sampler=batches, **workers)
    data.epoch_sampler = sampler
    data.sample_source = source  # class names and sample files, for reports (GeneratorDataset owns `source`)
    data.bad_samples = bad_samples
    data.normalization = normalization_of(dataset)
    return data


def create_train_input_stage(dataset: str, augmentation: Augmentation, class_num: int) -> TrainInputStage:
    """The training graph's first cell for the batches of `create_dataset(dataset, training=True,
    augmentation=augmentation)`: normalization, then erasing and mixing where the recipe has them."""
    return TrainInputStage(normalization_of(dataset), batch_stage=augmentation.needs_batch_stage,
                           mixes=augmentation.mixes, num_classes=class_num)


def set_start_epoch(data: ds.Dataset, epoch: int) -> None:
    """Make the first epoch `data` yields be `epoch` (for resuming), before it is iterated."""
    data.epoch_sampler.epoch = epoch


def create_eval_dataset(cfg, *, rank: int = 0, group_size: int = 1) -> ds.Dataset:
    """The evaluation split of a run's config (train.py and eval.py): eval_dataset_path, else
    data_path's test_batch.bin or val/ folder, split exactly across `group_size` ranks."""
    return create_dataset(cfg.dataset, cfg.eval_dataset_path or cfg.data_path, training=False,
                          batch_size=cfg.batch_size, image_size=cfg.eval_image_size, class_num=cfg.class_num,
                          num_parallel_workers=cfg.num_parallel_workers, worker_kind=cfg.data_worker_kind,
                          num_shards=group_size, shard_id=rank,
                          interpolation=cfg.interpolation, resize_size=cfg.eval_resize_size)
