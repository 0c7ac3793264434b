"""One dataset factory for CIFAR-10 binary files and ImageNet-style class folders.

The pipeline's randomness (sample order and augmentation) is a pure function of
(seed, epoch, sample index): an `EpochSampler` hands out keys `(epoch * ra_reps + repeat) * N +
index`, and the source derives each sample's crop, flip, policy and erasing box from that key; batch
mixing draws from a generator keyed by the batch's first key. So a run resumed at epoch k sees
exactly the data an uninterrupted run would, whatever the number of workers.
Sharding is done here too: eval shards split the samples exactly (nothing dropped or
repeated); training shards are equal-sized slices of the epoch's permutation.
"""
import functools
import glob
import math
import os
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import cv2
import numpy as np
from PIL import Image

import mindspore.dataset as ds
import mindspore.dataset.vision as vision

from src.data.auto_augment import create_policy, interpolation_mode
from src.data.bad_samples import UNREADABLE_ERRORS, BadSampleLog, bad_sample_limit, reason_of, sample_name
from src.data.batch_mixing import check_mixing, mix_batch
from src.data.image_decode import crop_resize, open_image
from src.data.random_erasing import erase, erase_box
from src.deploy.inference import read_class_names
from src.device import worker_budget
from src.errors import UserInputError

DATASETS = ("cifar10", "imagenet2012", "flower_photos")
# Class-folder datasets: the sub-folder each evaluates on (the model zoo's flower_photos has train/ and test/).
EVAL_FOLDERS = {"imagenet2012": "val", "flower_photos": "test"}
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
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
    """CIFAR augmentation: zero-pad, crop back to the original size at random, flip half the time."""
    height, width = image.shape[:2]
    padded = np.pad(image, ((padding, padding), (padding, padding), (0, 0)))
    top, left = rng.integers(0, 2 * padding + 1, size=2)
    out = padded[top:top + height, left:left + width]
    return out[:, ::-1] if rng.random() < 0.5 else out


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


def folder_train_transform(image, size: int, rng: np.random.Generator,
                           interpolation: str = "bilinear", antialias: bool = True) -> np.ndarray:
    """ImageNet augmentation: random resized crop to size x size, flip half the time. The resize
    antialiases as Pillow does (bilinear: OpenCV's approximation of it) or, without `antialias`,
    samples as the model zoo's native pipeline does (src/data/image_decode.py RESIZE_MODES)."""
    left, top, crop_w, crop_h = random_resized_crop_box(image.width, image.height, rng)
    array = crop_resize(image, (left, top, left + crop_w, top + crop_h), (size, size), pil_interpolation(interpolation),
                        mode="fast" if antialias else "plain")
    return cv2.flip(array, 1) if rng.random() < 0.5 else array


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
    the erasing box. `to_input` turns the augmented uint8 image into the network's input. With
    `batch_stage`, rows also carry the key and the box for the batch map.
    With a `bad_samples` log, an unreadable sample (failing at open or at decode) is recorded and
    replaced by the next readable index, augmented as the key says: the replacement depends on the
    key alone, so resume stays exact. Without one, it is an error naming the file."""

    def __init__(self, source, transform: Callable, to_input: Callable, augment: bool, seed: int, *,
                 policy: Optional[Callable] = None, erase_probability: float = 0.0, image_size: int = 0,
                 batch_stage: bool = False,
                 bad_samples: Optional[BadSampleLog] = None, keys_per_epoch: int = 0):
        self.source = source
        self.transform = transform
        self.to_input = to_input
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

    def _sample(self, key: int, index: int):
        rng = np.random.default_rng([self.seed, key]) if self.augment else None
        image = self.transform(self.source.load(index), rng)
        if self.policy is not None and rng is not None:
            image = self.policy(np.ascontiguousarray(image), rng)
        row = (self.to_input(image), self.source.labels[index])
        if not self.batch_stage:
            return row
        box = erase_box(self.image_size, self.image_size, rng, self.erase_probability)
        return row + (np.int64(key), np.asarray(box, dtype=np.int32))

    def __getitem__(self, key: int):
        key = int(key)
        total = len(self.source)
        first = key % total
        for index in (i % total for i in range(first, first + total)):
            if index in self.known_bad:
                continue
            try:
                return self._sample(key, index)
            except UNREADABLE_ERRORS as err:
                if self.bad_samples is None:
                    raise UserInputError(f"cannot read {sample_name(self.source, index)} ({reason_of(err)}); "
                                         f"remove or replace the file") from None
                self.known_bad.add(index)
                self.bad_samples.add(key // self.keys_per_epoch, index, sample_name(self.source, index),
                                     reason_of(err))
        raise UserInputError("no readable sample in the dataset; check the image files")


class BatchStage:
    """The batch map of the training recipe: erase each sample's box (after normalization), then
    mix the batch with a generator keyed by (seed, the batch's first sample key)."""

    def __init__(self, augmentation: Augmentation, num_classes: int, seed: int):
        self.augmentation, self.num_classes, self.seed = augmentation, num_classes, seed

    def __call__(self, images, labels, keys, boxes, batch_info=None):
        images = erase(np.stack(images), np.stack(boxes))
        labels = np.asarray(labels)
        if self.augmentation.mixes:
            rng = np.random.default_rng([self.seed, MIXING_STREAM, int(keys[0])])
            images, labels = mix_batch(images, labels, rng, num_classes=self.num_classes,
                                       mixup_alpha=self.augmentation.mixup_alpha,
                                       cutmix_alpha=self.augmentation.cutmix_alpha)
        return images, labels


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
    """The per-sample (Python) transform of `dataset`; it gets rng=None when augmentation is off."""
    if dataset == "cifar10":
        def transform(image, rng):
            return image if rng is None else random_crop_flip(image, rng)
        return transform

    def transform(image, rng):
        if rng is None:
            return folder_eval_transform(image, image_size, resize_size, interpolation)
        return folder_train_transform(image, image_size, rng, interpolation, antialias)
    return transform


@functools.lru_cache(maxsize=None)
def _blob_params(mean: Tuple[float, ...], std: Tuple[float, ...]):
    return cv2.dnn.Image2BlobParams(scalefactor=tuple(1 / (255 * s) for s in std) + (0,),
                                    mean=tuple(255 * m for m in mean) + (0,), ddepth=cv2.CV_32F,
                                    datalayout=cv2.dnn.DNN_LAYOUT_NCHW)


def network_input(image: np.ndarray, dataset: str, image_size: int, interpolation: str = "bilinear") -> np.ndarray:
    """An RGB uint8 HWC image as the network takes it: resized to image_size x image_size where it
    has another size (CIFAR only: folder transforms already give that size), normalized with the
    dataset's mean and std, float32 CHW. One OpenCV call does the normalization and the transpose
    (2.5x MindSpore's Normalize + HWC2CHW on a 224px image)."""
    if image.shape[:2] != (image_size, image_size):
        image = vision.Resize((image_size, image_size), interpolation_mode(interpolation))(image)
    mean, std = (CIFAR_MEAN, CIFAR_STD) if dataset == "cifar10" else (IMAGENET_MEAN, IMAGENET_STD)
    return cv2.dnn.blobFromImageWithParams(np.ascontiguousarray(image), _blob_params(mean, std))[0]


def preprocess_eval_image(image: Image.Image, dataset: str, image_size: int, resize_size: int = 0,
                          interpolation: str = "bilinear") -> np.ndarray:
    """One image as evaluation feeds it to the network: float32 CHW, normalized (for prediction).

    The steps of `create_dataset(..., training=False)`, with the same operations: 'imagenet2012'
    applies the eval transform (short side to `resize_size`, default image_size / 0.875, center
    crop); 'cifar10' resizes to image_size x image_size unless the image already has that size
    (CIFAR evaluates without a crop); then the dataset's normalization."""
    if dataset not in DATASETS:
        raise UserInputError(f"unknown dataset '{dataset}'; choose one of {', '.join(DATASETS)}")
    image = image.convert("RGB")
    if dataset == "cifar10":
        array = np.asarray(image)
    else:
        array = _transform(dataset, image_size, resize_size, interpolation)(image, None)
    return network_input(array, dataset, image_size, interpolation)


def _source_workers(dataset: str, num_parallel_workers: int) -> dict:
    """How the Python source runs. CIFAR samples are array slices: one thread is fastest (more
    only contend for the GIL; 3,800 vs 2,500 img/s measured). Folder samples are JPEG decodes and
    resizes: worker processes, for hosts with cores to spare (on 2 cores a second worker added
    nothing, threads or processes: README "ImageNet input pipeline")."""
    if dataset == "cifar10" or num_parallel_workers <= 1:
        return {"num_parallel_workers": 1, "python_multiprocessing": False}
    return {"num_parallel_workers": num_parallel_workers, "python_multiprocessing": True}


def create_source(dataset: str, data_path: str, training: bool):
    """The raw sample source for `dataset` ('cifar10' binary files, 'imagenet2012' or 'flower_photos'
    class folders)."""
    if dataset == "cifar10":
        return CifarBinarySource(data_path, training)
    if dataset in EVAL_FOLDERS:
        return ImageFolderSource(data_path, training, eval_folder=EVAL_FOLDERS[dataset])
    raise UserInputError(f"unknown dataset '{dataset}'; choose one of {', '.join(DATASETS)}")


def create_dataset(dataset: str, data_path: str, *, training: bool, batch_size: int, image_size: int,
                   class_num: Optional[int] = None, num_parallel_workers: int = 2, num_shards: int = 1,
                   shard_id: int = 0, seed: int = 1, start_epoch: int = 0,
                   shuffle: Optional[bool] = None, augment: Optional[bool] = None,
                   augmentation: Augmentation = PLAIN, interpolation: str = "bilinear",
                   resize_size: int = 0, antialias: bool = True, bad_sample_file: Optional[str] = None,
                   max_bad_samples: int = -1,
                   skip_samples: int = 0) -> ds.Dataset:
    """A batched dataset of (image float32 CHW normalized, label int32 - or float32 soft targets
    [batch, class_num] when `augmentation` mixes batches).

    Training drops the last partial batch; evaluation keeps every sample exactly once.
    `shuffle` and `augment` default to `training`; `augmentation` (the recipe beyond crop and flip)
    applies only where `augment` is on. `interpolation` (bilinear, bicubic, nearest) drives every
    resize and geometric operation; `resize_size` is evaluation's short side (0: image_size / 0.875);
    `antialias` off resizes training crops without antialiasing (the model zoo's way, faster).
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
    source = create_source(dataset, data_path, training)
    num_parallel_workers = worker_budget(num_parallel_workers)  # entry points cap (and log) per rank first
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
    columns = ["image", "label"] + (["key", "erase"] if batch_stage else [])
    bad_samples = None
    if bad_sample_file:
        bad_samples = BadSampleLog(bad_sample_file, bad_sample_limit(max_bad_samples, len(source)))
    source_rows = AugmentedSource(source, _transform(dataset, image_size, resize_size, interpolation, antialias),
                                  functools.partial(network_input, dataset=dataset, image_size=image_size,
                                                    interpolation=interpolation),
                                  augment, seed, policy=policy, image_size=image_size,
                                  erase_probability=augmentation.random_erase, batch_stage=batch_stage,
                                  bad_samples=bad_samples, keys_per_epoch=len(source) * sampler.repeats)
    data = ds.GeneratorDataset(source_rows, columns, sampler=sampler, **_source_workers(dataset, num_parallel_workers))
    if batch_stage:
        data = data.batch(batch_size, drop_remainder=training, input_columns=columns,
                          output_columns=["image", "label"],
                          per_batch_map=BatchStage(augmentation, class_num or 0, seed))
    else:
        data = data.batch(batch_size, drop_remainder=training)
    data.epoch_sampler = sampler
    data.source = source  # class names and sample files, for reports
    data.bad_samples = bad_samples
    return data


def set_start_epoch(data: ds.Dataset, epoch: int) -> None:
    """Make the first epoch `data` yields be `epoch` (for resuming), before it is iterated."""
    data.epoch_sampler.epoch = epoch


def create_eval_dataset(cfg, *, rank: int = 0, group_size: int = 1) -> ds.Dataset:
    """The evaluation split of a run's config (train.py and eval.py): eval_dataset_path, else
    data_path's test_batch.bin or val/ folder, split exactly across `group_size` ranks."""
    return create_dataset(cfg.dataset, cfg.eval_dataset_path or cfg.data_path, training=False,
                          batch_size=cfg.batch_size, image_size=cfg.eval_image_size, class_num=cfg.class_num,
                          num_parallel_workers=cfg.num_parallel_workers, num_shards=group_size, shard_id=rank,
                          interpolation=cfg.interpolation, resize_size=cfg.eval_resize_size)
