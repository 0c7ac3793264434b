"""Cross-entropy with label smoothing, PyTorch's definition: target = (1 - e) * target + e / K, for
integer labels and for soft targets (the probabilities mixup and cutmix produce) alike."""
from typing import Any

from mindspore import nn, ops


class CrossEntropySmooth(nn.Cell):
    """Mean cross-entropy of logits against integer labels [batch] or soft targets [batch, K],
    with label smoothing `smooth_factor`."""

    def __init__(self, num_classes: int, smooth_factor: float = 0.0):
        super().__init__()
        self.num_classes = num_classes
        self.smooth_factor = smooth_factor
        self.on_value = 1.0 - smooth_factor + smooth_factor / num_classes
        self.off_value = smooth_factor / num_classes
        self.log_softmax = nn.LogSoftmax(axis=-1)

    def construct(self, logits, labels):
        if labels.ndim == 1:
            target = ops.one_hot(labels, self.num_classes, self.on_value, self.off_value)
        else:
            target = labels * (1.0 - self.smooth_factor) + self.off_value
        target = ops.cast(target, logits.dtype)
        return -(target * self.log_softmax(logits)).sum(axis=-1).mean()


def create_loss(*, num_classes: int, label_smooth_factor: float = 0.0) -> nn.Cell:
    """The training loss: cross-entropy, smoothed when `label_smooth_factor` > 0."""
    return CrossEntropySmooth(num_classes, label_smooth_factor)


def label_smoothing(cfg: Any) -> float:
    """The smoothing a config (any object with its keys) asks for: label_smooth_factor when use_label_smooth."""
    return cfg.label_smooth_factor if cfg.use_label_smooth else 0.0


def loss_from_config(cfg: Any) -> nn.Cell:
    """The loss a config (any object with its keys) names: class_num classes, smoothed by
    label_smooth_factor when use_label_smooth."""
    return create_loss(num_classes=cfg.class_num,
                       label_smooth_factor=label_smoothing(cfg))
