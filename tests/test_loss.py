"""src/training/loss.py: label-smoothed cross-entropy against a numpy computation."""
import numpy as np
import pytest
from mindspore import Tensor

from src.training.loss import CrossEntropySmooth, create_loss

LOGITS = np.array([[2.0, -1.0, 0.5, 0.0],
                   [0.1, 0.2, 0.3, 0.4],
                   [-3.0, 4.0, 1.0, -0.5]], np.float32)
LABELS = np.array([0, 3, 1], np.int32)


def numpy_loss(logits, labels, smooth):
    logits = logits.astype(np.float64)
    k = logits.shape[1]
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    target = (1 - smooth) * np.eye(k)[labels] + smooth / k
    return float(-(target * log_softmax).sum(axis=1).mean())


def ms_loss(cell, logits=LOGITS, labels=LABELS):
    return float(cell(Tensor(logits), Tensor(labels)).asnumpy())


@pytest.mark.parametrize("smooth", [0.0, 0.1, 0.3])
def test_matches_numpy(smooth):
    assert ms_loss(CrossEntropySmooth(4, smooth)) == pytest.approx(numpy_loss(LOGITS, LABELS, smooth), rel=1e-5)


def test_no_smoothing_is_plain_cross_entropy():
    # -log softmax of the true class, averaged; row 2 ([0.1, 0.2, 0.3, 0.4], label 3) by hand:
    row = np.log(np.exp([0.1, 0.2, 0.3, 0.4]).sum()) - 0.4
    assert numpy_loss(LOGITS[1:2], LABELS[1:2], 0.0) == pytest.approx(row, rel=1e-7)
    plain = np.mean([np.log(np.exp(LOGITS[i].astype(np.float64)).sum()) - LOGITS[i, LABELS[i]]
                     for i in range(3)])
    assert ms_loss(CrossEntropySmooth(4, 0.0)) == pytest.approx(plain, rel=1e-5)


def test_smoothing_changes_the_value():
    assert abs(ms_loss(CrossEntropySmooth(4, 0.1)) - ms_loss(CrossEntropySmooth(4, 0.0))) > 1e-3


def test_uniform_logits_give_log_k_whatever_the_smoothing():
    logits = np.zeros((2, 10), np.float32)
    labels = np.array([3, 7], np.int32)
    for smooth in (0.0, 0.1):
        assert ms_loss(CrossEntropySmooth(10, smooth), logits, labels) == pytest.approx(np.log(10), rel=1e-5)


def test_a_label_far_below_the_largest_logit_costs_its_distance_not_inf():
    """A logit 200 below the largest: MindSpore's CPU SoftmaxCrossEntropyWithLogits gives inf there
    (exp underflows from ~87), which SCOP's knockoff stage logged before it took this loss."""
    logits = np.zeros((4, 10), np.float32)
    logits[:, 3] = 200.0
    labels = np.array([0, 3, 3, 3], np.int32)
    assert ms_loss(create_loss(num_classes=10), logits, labels) == pytest.approx(50.0, rel=1e-6)
    assert ms_loss(create_loss(num_classes=10), logits, labels) == pytest.approx(numpy_loss(logits, labels, 0.0))


def test_create_loss():
    cell = create_loss(num_classes=4, label_smooth_factor=0.1)
    assert ms_loss(cell) == pytest.approx(numpy_loss(LOGITS, LABELS, 0.1), rel=1e-5)
    assert ms_loss(create_loss(num_classes=4)) == pytest.approx(numpy_loss(LOGITS, LABELS, 0.0), rel=1e-5)
