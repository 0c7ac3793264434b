"""The training run's data from its config: the pipeline, its batches on the host, the data check."""
import os
import sys
import tempfile
from typing import Iterator, List, Optional, Tuple

import numpy as np

from src.config import Config
from src.data.bad_samples import bad_sample_limit, raise_if_too_many, scan_unreadable
from src.data.host_stage import host_input_stage
from src.dataset import Augmentation, create_dataset, create_source, normalization_of


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
