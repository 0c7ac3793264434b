"""Evaluation counts: ties, non-finite logits, the summary, and a short last batch."""
import mindspore as ms
import mindspore.dataset as ds
import numpy as np
from mindspore import nn
from mindspore.graph.api import cells_compile_cache  # MindSpore's own record of compiled cells

from src.evaluation.metrics import ClassificationCounts, evaluate_sums, summarize


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


def compiled_graphs() -> int:
    """Graphs MindSpore has compiled for the cells alive in this process (one per cell and input shape)."""
    return sum(len(phases) for phases in cells_compile_cache.values())


def test_a_short_last_batch_runs_padded_in_the_first_batchs_graph():
    """10 samples in batches of 4: the last 2 run padded to 4 and cut back, so an evaluation
    compiles one graph (a second, for the remainder's shape, cost ~0.45 CPU s per eval.py run), and
    each sample counts once, as the network scores the samples together."""
    rng = np.random.default_rng(0)
    images = rng.standard_normal((10, 6)).astype(np.float32)
    labels = rng.integers(0, 5, 10).astype(np.int32)
    data = ds.NumpySlicesDataset({"image": images, "label": labels}, shuffle=False).batch(4)
    net = nn.Dense(6, 5)
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        compiled_before = compiled_graphs()
        sums = evaluate_sums(net, data, {"counts": ClassificationCounts()})
        compiled = compiled_graphs() - compiled_before
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    np.testing.assert_allclose(sums["counts"], counts(net(ms.Tensor(images)).asnumpy(), labels), rtol=1e-6)
    assert sums["counts"][3] == 10
    assert compiled == 1
