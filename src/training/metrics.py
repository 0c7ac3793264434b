"""Evaluation: top-1/top-5 counts, mean loss and the sample count, summed over ranks."""
from typing import Callable, Dict

import numpy as np
from mindspore import nn
from mindspore.train import Metric, Model

from src.loss import create_loss
from src.training.distributed import all_reduce_sum


class ClassificationCounts(Metric):
    """Accumulates correct top-1, correct top-5, summed cross-entropy and the number of samples."""

    def __init__(self):
        super().__init__()
        self.clear()

    def clear(self) -> None:
        self.totals = np.zeros(4, dtype=np.float64)  # top1, top5, loss_sum, samples

    def update(self, *inputs) -> None:
        self.add(inputs[0].asnumpy(), inputs[1].asnumpy())

    def add(self, logits: np.ndarray, labels: np.ndarray) -> None:
        """Count one batch of logits [batch, classes] against its integer labels."""
        logits = logits.astype(np.float64)
        labels = labels.astype(np.int64)
        true_logit = logits[np.arange(len(labels)), labels]
        # The true class's rank: classes scoring higher, plus equal ones of lower index (argmax's
        # tie-break); a non-finite score never counts as correct (a diverged run scores 0).
        higher = (logits > true_logit[:, None]).sum(axis=1)
        tied_before = ((logits == true_logit[:, None]) & (np.arange(logits.shape[1]) < labels[:, None])).sum(axis=1)
        rank = np.where(np.isfinite(logits).all(axis=1), higher + tied_before, np.iinfo(np.int64).max)
        shifted = logits - logits.max(axis=1, keepdims=True)
        loss = np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(len(labels)), labels]
        self.totals += [np.sum(rank < 1), np.sum(rank < 5), loss.sum(), len(labels)]

    def eval(self) -> np.ndarray:
        return self.totals.copy()


def summarize(totals: np.ndarray) -> Dict[str, float]:
    """Accuracies and mean loss from summed counts."""
    top1, top5, loss_sum, samples = totals
    samples = max(samples, 1.0)
    return {"top_1_accuracy": top1 / samples, "top_5_accuracy": top5 / samples,
            "loss": loss_sum / samples, "samples": int(totals[3])}


def evaluate(net: nn.Cell, dataset, *, num_classes: int, group_size: int = 1) -> Dict[str, float]:
    """Evaluate `net` over this rank's shard of `dataset`; with several ranks, the counts of all
    shards are summed so every rank returns the same numbers for the whole split."""
    net.set_train(False)
    model = Model(net, loss_fn=create_loss(num_classes=num_classes), metrics={"counts": ClassificationCounts()})
    totals = model.eval(dataset, dataset_sink_mode=False)["counts"]
    if group_size > 1:
        totals = all_reduce_sum(totals)
    return summarize(totals)


def evaluate_outputs(run: Callable[[np.ndarray], np.ndarray], dataset, *, group_size: int = 1) -> Dict[str, float]:
    """`evaluate` for a model given as a function from an image batch to its logits (an exported
    file): the same counts over this rank's shard of `dataset`, summed over ranks."""
    counts = ClassificationCounts()
    for images, labels in dataset.create_tuple_iterator(output_numpy=True, num_epochs=1):
        counts.add(run(images), labels)
    totals = counts.eval()
    if group_size > 1:
        totals = all_reduce_sum(totals)
    return summarize(totals)
