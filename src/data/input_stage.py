"""The end of the input pipeline, run as the network's first cell: uint8 NHWC batches in,
normalized float32 NCHW out, with random erasing and mixup/cutmix for the training recipe.

The host hands over uint8 HWC pixels (4x fewer bytes than float32 CHW, one hand-over per batch)
and the random draws that decide the float work: each sample's erase box and the batch's mixing
weights and CutMix box. The stage does the arithmetic in the graph, where an Ascend card fuses it
and host-to-device traffic drops 4x. `host_*` functions are the same computation in numpy, for
exported models that take float32 NCHW input and for checking the stage (src/data/host_stage.py).
"""
import mindspore as ms
from mindspore import Tensor, nn, ops

from src.data.host_stage import Normalization


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
