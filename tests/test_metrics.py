"""Evaluation counts: ties, non-finite logits, and the summary."""
import mindspore as ms
import numpy as np

from src.training.metrics import ClassificationCounts, summarize


def counts(logits, labels) -> np.ndarray:
    metric = ClassificationCounts()
    metric.update(ms.Tensor(np.asarray(logits, np.float32)), ms.Tensor(np.asarray(labels, np.int32)))
    return metric.eval()


def test_clear_winner_and_top5():
    logits = [[0, 9, 1, 2, 3, 4, 5], [9, 0, 1, 2, 3, 4, 5]]
    top1, top5, _, samples = counts(logits, [1, 1])
    assert (top1, top5, samples) == (1, 1, 2)  # the second sample's true class ranks 7th


def test_ties_break_like_argmax_and_nan_is_never_correct():
    top1, top5, loss_sum, samples = counts([[1, 1, 1], [np.nan] * 3], [1, 0])
    assert (top1, samples) == (0, 2)  # argmax of a tie is index 0, not the label 1
    assert top5 == 1  # only the finite row is within the top 5 of 3 classes
    assert np.isnan(loss_sum)


def test_summary_is_mean_over_samples():
    summary = summarize(np.array([3.0, 4.0, 2.0, 4.0]))
    assert summary == {"top_1_accuracy": 0.75, "top_5_accuracy": 1.0, "loss": 0.5, "samples": 4}
