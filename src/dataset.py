"""One dataset factory for CIFAR-10 binary files, ImageNet-style class folders, and the MindRecord
shards converted from either (python -m src.data.mindrecord), which give the very same batches.

Data workers build whole batches of uint8 RGB pixels (one hand-over per batch, 4x fewer bytes than
float32); the network's first cell normalizes them and applies erasing and mixing
(src/data/input_stage.py). The pipeline's randomness (sample order and augmentation) is a pure
function of (seed, epoch, sample index): an `EpochSampler` hands out keys `(epoch * ra_reps +
repeat) * N + index`, and the source derives each sample's crop, flip, policy and erasing box from
that key; batch mixing draws from a generator keyed by the batch's first key. So a run resumed at
epoch k sees exactly the data an uninterrupted run would, whatever the number or kind of workers.
Eval shards split the samples exactly (nothing dropped or repeated); training shards are
equal-sized slices of the epoch's permutation.

This module composes what src/data/ holds: the sources (sources.py, shards.py), the per-sample
transforms (transforms.py), the samplers (sampling.py) and the batch assembly (batches.py).
"""
from typing import Optional

import cv2
import mindspore.dataset as ds
import numpy as np
from PIL import Image

from src.data.auto_augment import create_policy
from src.data.bad_samples import BadSampleLog, bad_sample_limit
from src.data.batches import AugmentedSource, BatchAssembly, BatchKeys, BatchSource
from src.data.host_stage import (  # noqa: F401 (statistics and normalization re-exported for callers of this face)
    CIFAR_MEAN,
    CIFAR_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    host_normalize,
    normalization_of,
)
from src.data.input_stage import TrainInputStage
from src.data.recipe import PLAIN, Augmentation
from src.data.sampling import BatchSampler, EpochSampler
from src.data.shards import ENCODED, PIXELS, MindRecordSource, RecordAssembly, RecordBatches, shard_folder
from src.data.sources import CifarBinarySource, ImageFolderSource
from src.data.transforms import fit_size, sample_transform
from src.device import worker_budget
from src.errors import UserInputError

DATASETS = ("cifar10", "imagenet2012", "flower_photos")
# Class-folder datasets: the sub-folder each evaluates on (the model zoo's flower_photos has train/ and test/).
EVAL_FOLDERS = {"imagenet2012": "val", "flower_photos": "test"}


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
    return sample_transform(dataset, image_size, resize_size, interpolation)(image, None)



def load_pixels(path: str, dataset: str, image_size: int, resize_size: int = 0,
                interpolation: str = "bilinear") -> np.ndarray:
    """One image file as the eval transform crops it: uint8 HWC RGB, before normalization."""
    try:
        with Image.open(path) as image:
            return eval_image(image, dataset, image_size, resize_size, interpolation)
    except (OSError, ValueError) as err:
        raise UserInputError(f"cannot read image {path} ({err}); pass image files") from None

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
    class folders), or the MindRecord shards converted from them where the split's folder holds
    shards (`data_path`/train, `data_path`/val or test, or `data_path` itself)."""
    if dataset not in DATASETS:
        raise UserInputError(f"unknown dataset '{dataset}'; choose one of {', '.join(DATASETS)}")
    shards = shard_folder(data_path, "train" if training else EVAL_FOLDERS.get(dataset, "val"))
    if shards:
        return MindRecordSource(shards, kind=PIXELS if dataset == "cifar10" else ENCODED)
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
                   max_bad_samples: int = -1, bad_sample_warnings: bool = True,
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
    `bad_sample_warnings` False: a second pipeline over the training's draws (its own record),
    whose files the training's pipeline warns about.
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
        bad_samples = BadSampleLog(bad_sample_file, bad_sample_limit(max_bad_samples, len(source)),
                                   warn=bad_sample_warnings)
    samples = AugmentedSource(source, sample_transform(dataset, image_size, resize_size, interpolation, antialias),
                              augment, seed, policy=policy, image_size=image_size,
                              erase_probability=augmentation.random_erase, batch_stage=batch_stage,
                              bad_samples=bad_samples, keys_per_epoch=len(source) * sampler.repeats)
    batches = BatchSampler(sampler, batch_size, drop_remainder=training)
    keys = BatchKeys(sampler, batch_size, batches.batches_per_epoch)
    assembly = BatchAssembly(image_size, augmentation=augmentation, batch_stage=batch_stage, seed=seed)
    columns = ["image", "label"] + (["erase", "mix"] if batch_stage else [])
    if workers["python_multiprocessing"]:
        # The workers are forked from this process. Forked while OpenCV's thread pool has threads,
        # a worker inherits a pool it cannot stop: its first cv2.setNumThreads(1) hangs for good
        # (seen when earlier OpenCV work ran in this process). So this process's OpenCV runs on one
        # thread from here on, as every worker's does.
        cv2.setNumThreads(1)
    if isinstance(source, MindRecordSource):
        # One reader streams each epoch's records in the keys' order; the workers decode and augment.
        raw = ["keys", "images", "ends"]
        data = ds.GeneratorDataset(RecordBatches(source, keys), raw, sampler=batches, num_parallel_workers=1,
                                   python_multiprocessing=False)
        data = data.map(RecordAssembly(samples, assembly), input_columns=raw, output_columns=columns, **workers)
    else:
        data = ds.GeneratorDataset(BatchSource(samples, keys, assembly), columns, sampler=batches, **workers)
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
