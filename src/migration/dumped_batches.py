"""Batches dumped from a user's own PyTorch loader for a training-parity run (`--batches DIR`): one
NNNNNN_images.npy and NNNNNN_labels.npy per step, read and checked before either side sees them."""
import glob
import os
from typing import List, Tuple

import numpy as np

from src.config import Config
from src.errors import UserInputError

Batch = Tuple[np.ndarray, np.ndarray]


def check_batch_folder(folder: str, steps: int) -> None:
    """A folder of dumped batches holding at least `steps` steps' images."""
    if not os.path.isdir(folder):
        raise UserInputError(f"--batches {folder} is not a folder; dump NNNNNN_images.npy and NNNNNN_labels.npy "
                             f"per step into one")
    available = len(glob.glob(os.path.join(folder, "*_images.npy")))
    if available < steps:
        raise UserInputError(f"--batches {folder} holds {available} step(s) of *_images.npy, the run needs "
                             f"{steps}; lower --steps or dump more batches")


def read_batches(folder: str, steps: int, cfg: Config, first: int = 0) -> List[Batch]:
    """Steps `first`.. of a folder of dumped batches, checked: float32 NCHW images, int64 labels
    [B] or float32 soft targets [B, class_num], one batch size divisible by grad_accumulation_steps."""
    check_batch_folder(folder, first + steps)
    found = []
    for step in range(first, first + steps):
        images_path = os.path.join(folder, f"{step:06d}_images.npy")
        labels_path = os.path.join(folder, f"{step:06d}_labels.npy")
        try:
            images, labels = np.load(images_path, allow_pickle=False), np.load(labels_path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise UserInputError(f"--batches: cannot read step {step} ({err}); each step needs "
                                 f"{step:06d}_images.npy and {step:06d}_labels.npy") from None
        check_batch(images, labels, cfg, images_path)
        found.append((images, labels))
    sizes = {len(images) for images, _ in found}
    if len(sizes) > 1:
        raise UserInputError(f"--batches {folder}: batch sizes differ between steps ({sorted(sizes)}); use one size")
    return found


def check_batch(images: np.ndarray, labels: np.ndarray, cfg: Config, where: str) -> None:
    """One batch as both sides take it, or a one-line error naming `where` it came from."""
    if images.dtype != np.float32 or images.ndim != 4 or images.shape[1] != 3:
        raise UserInputError(f"{where}: images must be float32 [B, 3, H, W] (normalized NCHW), got {images.dtype} "
                             f"{list(images.shape)}")
    batch = images.shape[0]
    if labels.ndim == 1 and labels.dtype.kind in "iu":
        if labels.shape[0] != batch or labels.min() < 0 or labels.max() >= cfg.class_num:
            raise UserInputError(f"{where}: labels must be {batch} class indices in [0, {cfg.class_num}) "
                                 f"(class_num); got {labels.shape[0]} in [{labels.min()}, {labels.max()}]")
    elif labels.ndim == 2 and labels.dtype == np.float32:
        if labels.shape != (batch, cfg.class_num):
            raise UserInputError(f"{where}: soft targets must be [{batch}, {cfg.class_num}] (class_num), got "
                                 f"{list(labels.shape)}")
    else:
        raise UserInputError(f"{where}: labels must be int64 [B] or float32 soft targets [B, K], got "
                             f"{labels.dtype} {list(labels.shape)}")
    if batch % cfg.grad_accumulation_steps:
        raise UserInputError(f"{where}: batch {batch} is not divisible by grad_accumulation_steps "
                             f"{cfg.grad_accumulation_steps}")
