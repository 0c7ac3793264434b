"""The input stage's arithmetic in numpy (no MindSpore): dataset statistics, normalization of
uint8 NHWC pixels to float32 NCHW, erasing and the batch mixing that `erase` and `mix` columns
describe. The graph's cells (src/data/input_stage.py) compute the same; exported float models,
the PyTorch side of the training-parity tool and tests use these."""
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# The `mix` column: the weights of each image and of its partner (the batch rolled by one) for
# pixels and for targets, and the CutMix box (top, left, bottom, right; empty for mixup or none).
MIX_FIELDS = ("image_self", "image_partner", "target_self", "target_partner", "top", "left", "bottom", "right")
NO_MIX = np.array([1.0, 0.0, 1.0, 0.0, 0, 0, 0, 0], np.float32)


@dataclass(frozen=True)
class Normalization:
    """Per-channel mean and std (of pixel values scaled to 0..1) of a dataset's RGB images."""
    mean: Tuple[float, float, float]
    std: Tuple[float, float, float]

    def shift_and_scale(self) -> Tuple[np.ndarray, np.ndarray]:
        """float32 (3,) each: normalized = (pixel - shift) * scale."""
        return (np.array(self.mean, np.float64) * 255).astype(np.float32), \
            (1.0 / (255 * np.array(self.std, np.float64))).astype(np.float32)


def normalization_of(dataset: str) -> Normalization:
    """CIFAR-10's statistics for 'cifar10', ImageNet's for the class-folder datasets."""
    return Normalization(CIFAR_MEAN, CIFAR_STD) if dataset == "cifar10" else Normalization(IMAGENET_MEAN, IMAGENET_STD)


def host_normalize(images: np.ndarray, normalization: Normalization) -> np.ndarray:
    """uint8 NHWC -> normalized float32 NCHW, in numpy (what `NormalizeImages` computes)."""
    shift, scale = normalization.shift_and_scale()
    return np.ascontiguousarray(((images.astype(np.float32) - shift) * scale).transpose(0, 3, 1, 2))


def padded_to(batch: np.ndarray, size: int) -> np.ndarray:
    """`batch` with zero samples appended up to `size` samples: how a graph or a file of a fixed
    batch size takes a short last batch (the caller cuts the outputs back to `len(batch)`)."""
    if len(batch) >= size:
        return batch
    return np.concatenate([batch, np.zeros((size - len(batch),) + batch.shape[1:], batch.dtype)])


def host_mix(images: np.ndarray, targets: np.ndarray, mix: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Blend a normalized NCHW batch and its float32 targets with the batch rolled by one, as `mix` says."""
    image_self, image_partner, target_self, target_partner = (np.float32(value) for value in mix[:4])
    top, left, bottom, right = (int(value) for value in mix[4:])
    partner = np.roll(images, 1, axis=0)
    mixed = images * image_self + partner * image_partner
    mixed[:, :, top:bottom, left:right] = partner[:, :, top:bottom, left:right]
    return mixed, targets * target_self + np.roll(targets, 1, axis=0) * target_partner


def host_erase(images: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """Zero each normalized image inside its erase box (top, left, height, width; empty: none)."""
    erased = images.copy()
    for image, (top, left, height, width) in zip(erased, boxes.astype(np.int64)):
        image[:, top:top + height, left:left + width] = 0.0
    return erased


def host_input_stage(images: np.ndarray, labels: np.ndarray, erase: Optional[np.ndarray], mix: Optional[np.ndarray],
                     *, normalization: Normalization, num_classes: int, mixes: bool) -> Tuple[np.ndarray, np.ndarray]:
    """A training batch's columns -> (float32 NCHW images, labels): what `TrainInputStage` computes.
    Labels stay int classes unless the recipe `mixes`; then they are float32 soft targets [B, K]."""
    inputs = host_normalize(images, normalization)
    if erase is None:
        return inputs, labels
    inputs = host_erase(inputs, erase)
    if not mixes:
        return inputs, labels
    targets = np.eye(num_classes, dtype=np.float32)[labels.astype(np.int64)]
    return host_mix(inputs, targets, mix)
