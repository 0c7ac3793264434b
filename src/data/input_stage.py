"""The end of the input pipeline, run as the network's first cell: uint8 NHWC batches in,
normalized float32 NCHW out, with random erasing and mixup/cutmix for the training recipe.

The host hands over uint8 HWC pixels (4x fewer bytes than float32 CHW, one hand-over per batch)
and the random draws that decide the float work: each sample's erase box and the batch's mixing
weights and CutMix box. The stage does the arithmetic in the graph, where an Ascend card fuses it
and host-to-device traffic drops 4x. `host_*` functions are the same computation in numpy, for
exported models that take float32 NCHW input and for checking the stage.
"""
from dataclasses import dataclass
from typing import Tuple

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops

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


def host_mix(images: np.ndarray, targets: np.ndarray, mix: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Blend a normalized NCHW batch and its float32 targets with the batch rolled by one, as `mix` says."""
    image_self, image_partner, target_self, target_partner = (np.float32(value) for value in mix[:4])
    top, left, bottom, right = (int(value) for value in mix[4:])
    partner = np.roll(images, 1, axis=0)
    mixed = images * image_self + partner * image_partner
    mixed[:, :, top:bottom, left:right] = partner[:, :, top:bottom, left:right]
    return mixed, targets * target_self + np.roll(targets, 1, axis=0) * target_partner


class NormalizeImages(nn.Cell):
    """uint8 NHWC images -> float32 NCHW, normalized with the dataset's mean and std."""

    def __init__(self, normalization: Normalization):
        super().__init__()
        shift, scale = normalization.shift_and_scale()
        self.shift = Tensor(shift.reshape(1, 3, 1, 1))
        self.scale = Tensor(scale.reshape(1, 3, 1, 1))

    def construct(self, images):
        pixels = ops.transpose(ops.cast(images, ms.float32), (0, 3, 1, 2))
        return (pixels - self.shift) * self.scale


def _box_mask(top, left, bottom, right, height: int, width: int):
    """bool (B, 1, H, W): True inside each row's box; the bounds are (B, 1) tensors."""
    rows = ops.arange(height).reshape(1, height)
    columns = ops.arange(width).reshape(1, width)
    in_rows = ops.logical_and(rows >= top, rows < bottom)
    in_columns = ops.logical_and(columns >= left, columns < right)
    return ops.logical_and(in_rows.reshape(-1, 1, height, 1), in_columns.reshape(-1, 1, 1, width))


class TrainInputStage(nn.Cell):
    """Training's stage: normalize, erase each sample's box, then mix the batch with itself rolled
    by one (mixup or CutMix). Takes the dataset's columns (images, labels[, erase, mix]) and
    returns (images, labels): int labels, or float32 soft targets when the recipe mixes."""

    def __init__(self, normalization: Normalization, *, batch_stage: bool = False, mixes: bool = False,
                 num_classes: int = 0):
        super().__init__()
        self.normalize = NormalizeImages(normalization)
        self.batch_stage = batch_stage
        self.mixes = mixes
        self.num_classes = num_classes

    def erase(self, images, boxes):
        boxes = ops.cast(boxes, ms.int32)
        top, left = boxes[:, 0:1], boxes[:, 1:2]
        mask = _box_mask(top, left, top + boxes[:, 2:3], left + boxes[:, 3:4], images.shape[2], images.shape[3])
        return ops.masked_fill(images, mask, Tensor(0.0, ms.float32))

    def mix(self, images, labels, mix):
        targets = ops.one_hot(labels, self.num_classes, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))
        partner = ops.concat((images[-1:], images[:-1]), 0)
        partner_targets = ops.concat((targets[-1:], targets[:-1]), 0)
        box = ops.cast(mix[4:], ms.int32).reshape(1, 4)
        mask = _box_mask(box[:, 0:1], box[:, 1:2], box[:, 2:3], box[:, 3:4], images.shape[2], images.shape[3])
        blended = images * mix[0] + partner * mix[1]
        mixed = ops.select(ops.broadcast_to(mask, blended.shape), partner, blended)
        return mixed, targets * mix[2] + partner_targets * mix[3]

    def construct(self, images, labels, erase_boxes=None, mix=None):
        images = self.normalize(images)
        if self.batch_stage:
            images = self.erase(images, erase_boxes)
            if self.mixes:
                images, labels = self.mix(images, labels, mix)
        return images, labels


class WithInputStage(nn.Cell):
    """`net` behind the normalization stage: takes uint8 NHWC batches (evaluation, export with
    the input stage). Parameter names stay those of `net`."""

    def __init__(self, net: nn.Cell, normalization: Normalization):
        super().__init__(auto_prefix=False)
        self.normalize = NormalizeImages(normalization)
        self.net = net

    def construct(self, images):
        return self.net(self.normalize(images))
