"""Mixup and CutMix on a batch, torchvision's semantics: the batch is mixed with itself rolled by
one; labels become soft targets. With both on, each batch uses one of the two, chosen with
probability 0.5. The generator is keyed by the batch (seed and the batch's first sample key, i.e.
epoch, batch position and shard), so resume and data-parallel runs stay exact."""
import math
from typing import Tuple

import numpy as np

from src.errors import UserInputError


def one_hot(labels: np.ndarray, num_classes: int) -> np.ndarray:
    return np.eye(num_classes, dtype=np.float32)[labels]


def mixup(images: np.ndarray, targets: np.ndarray, lam: float) -> Tuple[np.ndarray, np.ndarray]:
    """lam * batch + (1 - lam) * batch rolled by one, for images and soft targets alike."""
    images = lam * images + (1.0 - lam) * np.roll(images, 1, axis=0)
    return images.astype(np.float32), lam * targets + (1.0 - lam) * np.roll(targets, 1, axis=0)


def cutmix_box(height: int, width: int, lam: float, rng: np.random.Generator) -> Tuple[int, int, int, int]:
    """(top, left, bottom, right) of a box of about (1 - lam) of the area around a random center,
    clipped to the image."""
    center_y, center_x = int(rng.integers(height)), int(rng.integers(width))
    half = 0.5 * math.sqrt(1.0 - lam)
    half_h, half_w = int(half * height), int(half * width)
    return (max(center_y - half_h, 0), max(center_x - half_w, 0),
            min(center_y + half_h, height), min(center_x + half_w, width))


def cutmix(images: np.ndarray, targets: np.ndarray, box: Tuple[int, int, int, int]) -> Tuple[np.ndarray, np.ndarray]:
    """Paste the rolled batch's `box` into each image; the targets' weight is the pasted area."""
    top, left, bottom, right = box
    images = images.copy()
    images[:, :, top:bottom, left:right] = np.roll(images, 1, axis=0)[:, :, top:bottom, left:right]
    lam = 1.0 - (bottom - top) * (right - left) / (images.shape[2] * images.shape[3])
    return images, lam * targets + (1.0 - lam) * np.roll(targets, 1, axis=0)


def check_mixing(mixup_alpha: float, cutmix_alpha: float) -> None:
    for key, value in (("mixup_alpha", mixup_alpha), ("cutmix_alpha", cutmix_alpha)):
        if value < 0:
            raise UserInputError(f"{key} must be >= 0 (0 turns it off), got {value}")


def mix_batch(images: np.ndarray, labels: np.ndarray, rng: np.random.Generator, *, num_classes: int,
              mixup_alpha: float, cutmix_alpha: float) -> Tuple[np.ndarray, np.ndarray]:
    """A NCHW float batch and int labels -> the mixed batch and float32 soft targets."""
    targets = one_hot(labels, num_classes)
    use_cutmix = cutmix_alpha > 0 and (mixup_alpha <= 0 or rng.random() < 0.5)
    alpha = cutmix_alpha if use_cutmix else mixup_alpha
    if alpha <= 0:
        return images, targets
    lam = float(rng.beta(alpha, alpha))
    if use_cutmix:
        images, targets = cutmix(images, targets, cutmix_box(images.shape[2], images.shape[3], lam, rng))
    else:
        images, targets = mixup(images, targets, lam)
    return images, targets.astype(np.float32)
