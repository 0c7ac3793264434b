"""Mixup and CutMix on a batch, torchvision's semantics: the batch is mixed with itself rolled by
one; labels become soft targets. The host draws the mixing (`draw_mix`); the training graph
applies it (src/data/input_stage.py). With both on, each batch uses one of the two, chosen with
probability 0.5. The generator is keyed by the batch (seed and the batch's first sample key, i.e.
epoch, batch position and shard), so resume and data-parallel runs stay exact."""
import math
from typing import Tuple

import numpy as np

from src.data.host_stage import NO_MIX, host_mix
from src.errors import UserInputError


def one_hot(labels: np.ndarray, num_classes: int) -> np.ndarray:
    return np.eye(num_classes, dtype=np.float32)[labels]


def cutmix_box(height: int, width: int, lam: float, rng: np.random.Generator) -> Tuple[int, int, int, int]:
    """(top, left, bottom, right) of a box of about (1 - lam) of the area around a random center,
    clipped to the image."""
    center_y, center_x = int(rng.integers(height)), int(rng.integers(width))
    half = 0.5 * math.sqrt(1.0 - lam)
    half_h, half_w = int(half * height), int(half * width)
    return (max(center_y - half_h, 0), max(center_x - half_w, 0),
            min(center_y + half_h, height), min(center_x + half_w, width))


def draw_mix(rng: np.random.Generator, height: int, width: int, *, mixup_alpha: float,
             cutmix_alpha: float) -> np.ndarray:
    """One batch's mixing as the dataset's `mix` column (src/data/input_stage.py MIX_FIELDS):
    mixup weighs pixels and targets by lam; CutMix pastes the partner's box and weighs the
    targets by the area kept."""
    use_cutmix = cutmix_alpha > 0 and (mixup_alpha <= 0 or rng.random() < 0.5)
    alpha = cutmix_alpha if use_cutmix else mixup_alpha
    if alpha <= 0:
        return NO_MIX.copy()
    lam = float(rng.beta(alpha, alpha))
    if not use_cutmix:
        return np.array([lam, 1.0 - lam, lam, 1.0 - lam, 0, 0, 0, 0], np.float32)
    top, left, bottom, right = cutmix_box(height, width, lam, rng)
    kept = 1.0 - (bottom - top) * (right - left) / (height * width)
    return np.array([1.0, 0.0, kept, 1.0 - kept, top, left, bottom, right], np.float32)


def check_mixing(mixup_alpha: float, cutmix_alpha: float) -> None:
    for key, value in (("mixup_alpha", mixup_alpha), ("cutmix_alpha", cutmix_alpha)):
        if value < 0:
            raise UserInputError(f"{key} must be >= 0 (0 turns it off), got {value}")


def mix_batch(images: np.ndarray, labels: np.ndarray, rng: np.random.Generator, *, num_classes: int,
              mixup_alpha: float, cutmix_alpha: float) -> Tuple[np.ndarray, np.ndarray]:
    """A normalized NCHW float batch and int labels -> the mixed batch and float32 soft targets,
    in numpy (the training graph does the same in src/data/input_stage.py TrainInputStage)."""
    mix = draw_mix(rng, images.shape[2], images.shape[3], mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha)
    return host_mix(images, one_hot(labels, num_classes), mix)
