"""One dataset factory for CIFAR-10 binary files and ImageNet-style class folders.

The pipeline's randomness (sample order and augmentation) is a pure function of
(seed, epoch, sample index): an `EpochSampler` hands out keys `epoch * N + index`, and the
source derives each sample's crop and flip from that key. So a run resumed at epoch k sees
exactly the data an uninterrupted run would, whatever the number of workers.
Sharding is done here too: eval shards split the samples exactly (nothing dropped or
repeated); training shards are equal-sized slices of the epoch's permutation.
"""
import glob
import math
import os
from typing import Callable, List, Optional, Tuple

import numpy as np
from PIL import Image

import mindspore.dataset as ds
import mindspore.dataset.vision as vision

from src.errors import UserInputError
from src.image_decode import crop_resize, open_image

DATASETS = ("cifar10", "imagenet2012")
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CIFAR_SIDE = 32
CIFAR_RECORD_BYTES = 1 + CIFAR_SIDE * CIFAR_SIDE * 3
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
EVAL_CROP_RATIO = 0.875  # resize to 256 then center-crop 224


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


def _cifar_folder(data_path: str) -> str:
    _require_folder(data_path)
    nested = os.path.join(data_path, "cifar-10-batches-bin")
    return nested if os.path.isdir(nested) else data_path


class ImageFolderSource:
    """Images in one sub-folder per class (sorted folder names give the labels)."""

    def __init__(self, data_path: str, training: bool):
        _require_folder(data_path)
        split = os.path.join(data_path, "train" if training else "val")
        if not training and not os.path.isdir(split) and os.path.isdir(os.path.join(data_path, "train")):
            raise UserInputError(f"{data_path} has train/ but no val/ folder to evaluate on; pass the "
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

    def load(self, index: int) -> Image.Image:
        """The image, opened lazily: the transform decodes only what its crop needs."""
        return open_image(self.paths[index])


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


def folder_train_transform(image: Image.Image, size: int, rng: np.random.Generator) -> np.ndarray:
    """ImageNet augmentation: random resized crop to size x size, flip half the time."""
    left, top, crop_w, crop_h = random_resized_crop_box(image.width, image.height, rng)
    array = crop_resize(image, (left, top, left + crop_w, top + crop_h), (size, size), Image.BILINEAR)
    return array[:, ::-1] if rng.random() < 0.5 else array


def folder_eval_transform(image: Image.Image, size: int) -> np.ndarray:
    """Resize the short side to size / 0.875 (256 for 224), then center-crop size x size."""
    short = int(round(size / EVAL_CROP_RATIO))
    scale = short / min(image.width, image.height)
    resized_w, resized_h = max(size, round(image.width * scale)), max(size, round(image.height * scale))
    left, top = (resized_w - size) // 2, (resized_h - size) // 2
    # The crop's box in the original image: resizing only it gives the pixels of resize-then-crop.
    scale_x, scale_y = resized_w / image.width, resized_h / image.height
    box = (left / scale_x, top / scale_y, (left + size) / scale_x, (top + size) / scale_y)
    return crop_resize(image, box, (size, size), Image.BILINEAR)


class AugmentedSource:
    """Random-access source over keys `epoch * N + index`; augmentation seeded by (seed, key)."""

    def __init__(self, source, transform: Callable, augment: bool, seed: int):
        self.source = source
        self.transform = transform
        self.augment = augment
        self.seed = seed

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: int):
        key = int(key)
        index = key % len(self.source)
        rng = np.random.default_rng([self.seed, key]) if self.augment else None
        image = self.transform(self.source.load(index), rng)
        return np.ascontiguousarray(image), self.source.labels[index]


class EpochSampler(ds.Sampler):
    """Yields keys `epoch * N + index` for this shard; each call to iter() is the next epoch.

    Training: the epoch's permutation (seeded by seed and epoch), cut into equal shards.
    Evaluation: every sample exactly once across shards, in order."""

    def __init__(self, num_samples: int, *, training: bool, shuffle: bool, num_shards: int,
                 shard_id: int, seed: int, start_epoch: int = 0):
        self.total = num_samples
        self.training = training
        self.shuffle = shuffle
        self.num_shards = num_shards
        self.shard_id = shard_id
        self.seed = seed
        self.epoch = start_epoch
        super().__init__()  # reads len(self)

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """The indices this shard reads in `epoch`."""
        order = np.arange(self.total)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.total)
        shard = order[self.shard_id::self.num_shards]
        return shard[:self.total // self.num_shards] if self.training else shard

    def __iter__(self):
        epoch = self.epoch
        self.epoch += 1
        for index in self.epoch_indices(epoch):
            yield int(epoch * self.total + index)

    def __len__(self) -> int:
        if self.training:
            return self.total // self.num_shards
        return len(range(self.shard_id, self.total, self.num_shards))


def _transforms(dataset: str, image_size: int):
    """The per-sample (Python) transform and the normalization constants of `dataset`.

    The transform gets rng=None when augmentation is off."""
    if dataset == "cifar10":
        def transform(image, rng):
            return image if rng is None else random_crop_flip(image, rng)
        return transform, CIFAR_MEAN, CIFAR_STD

    def transform(image, rng):
        if rng is None:
            return folder_eval_transform(image, image_size)
        return folder_train_transform(image, image_size, rng)
    return transform, IMAGENET_MEAN, IMAGENET_STD


def preprocess_eval_image(image: Image.Image, dataset: str, image_size: int) -> np.ndarray:
    """One image as evaluation feeds it to the network: float32 CHW, normalized (for prediction).

    The steps of `create_dataset(..., training=False)`, with the same operations: 'imagenet2012'
    applies the eval transform (short side to image_size / 0.875, center crop); 'cifar10' resizes
    to image_size x image_size unless the image already has that size (CIFAR evaluates without a
    crop); then the dataset's normalization."""
    if dataset not in DATASETS:
        raise UserInputError(f"unknown dataset '{dataset}'; choose one of {', '.join(DATASETS)}")
    transform, mean, std = _transforms(dataset, image_size)
    image = image.convert("RGB")
    if dataset == "cifar10":
        array = np.asarray(image)
        if array.shape[:2] != (image_size, image_size):
            array = vision.Resize((image_size, image_size))(array)
    else:
        array = transform(image, None)
    array = vision.Normalize([m * 255 for m in mean], [s * 255 for s in std])(np.ascontiguousarray(array))
    return np.ascontiguousarray(vision.HWC2CHW()(array), dtype=np.float32)


def _source_workers(dataset: str, num_parallel_workers: int) -> dict:
    """How the Python source runs. CIFAR samples are array slices: one thread is fastest (more
    only contend for the GIL; 3,800 vs 2,500 img/s measured). Folder samples are JPEGs decoded by
    PIL: worker processes, which pay off where cores are plentiful (on 2 cores, use 1 worker)."""
    if dataset == "cifar10" or num_parallel_workers <= 1:
        return {"num_parallel_workers": 1, "python_multiprocessing": False}
    return {"num_parallel_workers": num_parallel_workers, "python_multiprocessing": True}


def create_source(dataset: str, data_path: str, training: bool):
    """The raw sample source for `dataset` ('cifar10' binary files or 'imagenet2012' folders)."""
    if dataset == "cifar10":
        return CifarBinarySource(data_path, training)
    if dataset == "imagenet2012":
        return ImageFolderSource(data_path, training)
    raise UserInputError(f"unknown dataset '{dataset}'; choose one of {', '.join(DATASETS)}")


def create_dataset(dataset: str, data_path: str, *, training: bool, batch_size: int, image_size: int,
                   class_num: Optional[int] = None, num_parallel_workers: int = 2, num_shards: int = 1,
                   shard_id: int = 0, seed: int = 1, start_epoch: int = 0,
                   shuffle: Optional[bool] = None, augment: Optional[bool] = None) -> ds.Dataset:
    """A batched dataset of (image float32 CHW normalized, label int32).

    Training drops the last partial batch; evaluation keeps every sample exactly once.
    `shuffle` and `augment` default to `training`."""
    source = create_source(dataset, data_path, training)
    if class_num is not None and source.labels.max() >= class_num:
        raise UserInputError(f"{data_path} has label {int(source.labels.max())} but class_num is "
                             f"{class_num}; set --class_num to the number of classes")
    shuffle = training if shuffle is None else shuffle
    augment = training if augment is None else augment
    transform, mean, std = _transforms(dataset, image_size)
    sampler = EpochSampler(len(source), training=training, shuffle=shuffle, num_shards=num_shards,
                           shard_id=shard_id, seed=seed, start_epoch=start_epoch)
    if len(sampler) == 0 or (training and len(sampler) < batch_size):
        raise UserInputError(f"{data_path} gives {len(sampler)} samples to this shard, fewer than one "
                             f"batch of {batch_size}; lower batch_size or add data")
    data = ds.GeneratorDataset(AugmentedSource(source, transform, augment, seed), ["image", "label"],
                               sampler=sampler, **_source_workers(dataset, num_parallel_workers))
    ops = []
    if dataset == "cifar10" and image_size != CIFAR_SIDE:
        ops.append(vision.Resize((image_size, image_size)))
    ops += [vision.Normalize([m * 255 for m in mean], [s * 255 for s in std]), vision.HWC2CHW()]
    data = data.map(ops, input_columns="image", num_parallel_workers=num_parallel_workers)
    data = data.batch(batch_size, drop_remainder=training)
    data.epoch_sampler = sampler
    return data


def set_start_epoch(data: ds.Dataset, epoch: int) -> None:
    """Make the first epoch `data` yields be `epoch` (for resuming), before it is iterated."""
    data.epoch_sampler.epoch = epoch


def create_eval_dataset(cfg, *, rank: int = 0, group_size: int = 1) -> ds.Dataset:
    """The evaluation split of a run's config (train.py and eval.py): eval_dataset_path, else
    data_path's test_batch.bin or val/ folder, split exactly across `group_size` ranks."""
    return create_dataset(cfg.dataset, cfg.eval_dataset_path or cfg.data_path, training=False,
                          batch_size=cfg.batch_size, image_size=cfg.eval_image_size, class_num=cfg.class_num,
                          num_parallel_workers=cfg.num_parallel_workers, num_shards=group_size, shard_id=rank)
