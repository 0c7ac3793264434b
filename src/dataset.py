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
transforms (transforms.py), the samplers (sampling.py) and the batch assembly (batches.py). It is
the one face for data: the datasets from their arguments, and a run's training and evaluation
data, host batches and data check from its config.
"""
import os
import sys
import tempfile
from typing import Iterator, List, Optional, Tuple

import cv2
import mindspore.dataset as ds
import numpy as np
from PIL import Image

from src.config import Config
from src.data.auto_augment import create_policy
from src.data.bad_samples import BadSampleLog, bad_sample_limit, raise_if_too_many, scan_unreadable
from src.data.batches import AugmentedSource, BatchAssembly, BatchKeys, BatchSource
from src.data.host_stage import (  # noqa: F401 (statistics and normalization re-exported for callers of this face)
    CIFAR_MEAN,
    CIFAR_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    host_input_stage,
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


def create_eval_dataset(cfg: Config, *, rank: int = 0, group_size: int = 1) -> ds.Dataset:
    """The evaluation split of a run's config (train.py and eval.py): eval_dataset_path, else
    data_path's test_batch.bin or val/ folder, split exactly across `group_size` ranks."""
    return create_dataset(cfg.dataset, cfg.eval_dataset_path or cfg.data_path, training=False,
                          batch_size=cfg.batch_size, image_size=cfg.eval_image_size, class_num=cfg.class_num,
                          num_parallel_workers=cfg.num_parallel_workers, worker_kind=cfg.data_worker_kind,
                          num_shards=group_size, shard_id=rank,
                          interpolation=cfg.interpolation, resize_size=cfg.eval_resize_size)


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



# A run's training data from its config (train.py, the parity and learning tools).

def data_recipe(cfg: Config) -> Augmentation:
    """The training data recipe's switches from the config (keys of the same names)."""
    return Augmentation(auto_augment=cfg.auto_augment, ra_num_ops=cfg.ra_num_ops, ra_magnitude=cfg.ra_magnitude,
                        augmix_severity=cfg.augmix_severity, random_erase=cfg.random_erase,
                        mixup_alpha=cfg.mixup_alpha, cutmix_alpha=cfg.cutmix_alpha, ra_reps=cfg.ra_reps)


def create_train_dataset(cfg: Config, rank: int, group_size: int, folder: str, *, start_epoch: int = 0,
                         skip_batches: int = 0, warn: bool = True):
    """The training data from `start_epoch` on (each epoch without its first `skip_batches`
    batches); unreadable samples are replaced and recorded in `folder` (the run folder), and warned
    about unless `warn` is False (a second pipeline over the training's draws). One batch feeds one
    optimizer step: grad_accumulation_steps micro-batches of batch_size."""
    batch = cfg.batch_size * cfg.grad_accumulation_steps
    return create_dataset(cfg.dataset, cfg.data_path, training=True, batch_size=batch,
                          image_size=cfg.train_image_size, class_num=cfg.class_num,
                          num_parallel_workers=cfg.num_parallel_workers, worker_kind=cfg.data_worker_kind,
                          num_shards=group_size, shard_id=rank, seed=cfg.seed, start_epoch=start_epoch,
                          augmentation=data_recipe(cfg),
                          interpolation=cfg.interpolation, antialias=cfg.antialias,
                          skip_samples=skip_batches * batch,
                          bad_sample_file=os.path.join(folder, f"bad_samples_rank{rank}.tsv"),
                          max_bad_samples=cfg.max_bad_samples, bad_sample_warnings=warn)


def iter_host_batches(cfg: Config, rank: int, group_size: int, *, first: int,
                      count: Optional[int]) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
    """This rank's training batches of global steps first..first+count-1 (0-based; count None: to the
    end of that epoch), one at a time, through the input stage's host computation: float32 NCHW
    images, and int labels or soft targets. Every draw is a function of (seed, epoch, index), so
    they are the training's own batches."""
    recipe, normalization = data_recipe(cfg), normalization_of(cfg.dataset)
    given = 0
    with tempfile.TemporaryDirectory() as scratch:  # its record of unreadable samples: the training warns
        batches = create_train_dataset(cfg, rank, group_size, scratch, warn=False)
        per_epoch = batches.get_dataset_size()
        epoch, skip = divmod(first, per_epoch)
        count = per_epoch - skip if count is None else count
        while given < count:
            if (epoch, skip) != (0, 0):
                batches = create_train_dataset(cfg, rank, group_size, scratch, start_epoch=epoch, skip_batches=skip,
                                               warn=False)
            iterator = batches.create_tuple_iterator(num_epochs=1, output_numpy=True)
            for columns in iterator:
                images, labels, erase, mix = (list(columns) + [None, None])[:4]
                yield host_input_stage(images, labels, erase, mix, normalization=normalization,
                                       num_classes=cfg.class_num, mixes=recipe.mixes)
                given += 1
                if given == count:
                    break
            iterator.stop()
            epoch, skip = epoch + 1, 0
            batches = None  # the next epoch is a new pipeline


def host_batches(cfg: Config, rank: int, group_size: int, *, first: int,
                 count: Optional[int]) -> List[Tuple[np.ndarray, np.ndarray]]:
    """`iter_host_batches` as a list (a few steps' batches: the parity tools)."""
    return list(iter_host_batches(cfg, rank, group_size, first=first, count=count))


def steps_per_epoch_of(cfg: Config, rank: int = 0, group_size: int = 1) -> int:
    """The training steps of one epoch for this rank (the pipeline's size; nothing is read)."""
    with tempfile.TemporaryDirectory() as scratch:
        return create_train_dataset(cfg, rank, group_size, scratch).get_dataset_size()


def check_data(cfg: Config, log) -> None:
    """--check_data: open and decode every training image once; list the unreadable ones, and stop
    when they are more than max_bad_samples."""
    source = create_source(cfg.dataset, cfg.data_path, training=True)
    bad = scan_unreadable(source, workers=cfg.num_parallel_workers)
    for name, reason in bad:
        print(f"unreadable: {name} ({reason})", file=sys.stderr, flush=True)
    limit = bad_sample_limit(cfg.max_bad_samples, len(source))
    log(f"check_data: {len(bad)} of {len(source)} training images unreadable (max_bad_samples {limit})")
    raise_if_too_many([name for name, _ in bad], limit, "all listed above")


# The first training batch's picture shows this many of its images.
PICTURE_IMAGES = 32


def first_batch(cfg: Config, rank: int, group_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """The first training batch after the whole recipe (policies, erasing, mixing), back in uint8 RGB
    pixels [N, H, W, 3], with its targets. Read from a second pipeline: every draw is a function of
    (seed, epoch, index), so it is the training's batch (its unreadable samples, replaced the same
    way, are recorded by the training's own pipeline)."""
    images, targets = host_batches(cfg, rank, group_size, first=0, count=1)[0]
    shift, scale = normalization_of(cfg.dataset).shift_and_scale()
    pixels = images[:PICTURE_IMAGES].transpose(0, 2, 3, 1) / scale + shift
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8), targets[:PICTURE_IMAGES]
