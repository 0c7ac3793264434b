"""Evaluation: top-1/top-5 counts, mean loss and the sample count, summed over ranks."""
from typing import Callable, Dict

import numpy as np
from mindspore import Tensor, nn
from mindspore.train import Metric

from src.collective import all_reduce_sum
from src.cpu_layers import weights_frozen
from src.data.host_stage import padded_to
from src.data.input_stage import WithInputStage


def true_class_rank(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per row, the rank of the true class (0: top-1): classes scoring higher, plus equal ones of
    lower index (argmax's tie-break). A row with a non-finite score gets a rank no k reaches: it
    never counts as correct (a diverged run scores 0)."""
    true_logit = logits[np.arange(len(labels)), labels]
    higher = (logits > true_logit[:, None]).sum(axis=1)
    tied_before = ((logits == true_logit[:, None]) & (np.arange(logits.shape[1]) < labels[:, None])).sum(axis=1)
    return np.where(np.isfinite(logits).all(axis=1), higher + tied_before, np.iinfo(np.int64).max)


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
        rank = true_class_rank(logits, labels)
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


def evaluate_sums(net: nn.Cell, dataset, metrics: Dict[str, Metric], *, group_size: int = 1) -> Dict[str, np.ndarray]:
    """Run `metrics` (each one's eval() a vector of sums) over this rank's shard of `dataset` in
    one pass; with several ranks, the vectors are summed over all shards (one allreduce), so every
    rank returns the sums of the whole split. A short last batch runs padded to the first batch's
    size and cut back: one compiled graph per evaluation, not a second for the remainder's shape."""
    net.set_train(False)
    cell = eval_cell(net, getattr(dataset, "normalization", None))  # create_dataset's uint8 batches
    first = {}

    def run(images: np.ndarray) -> np.ndarray:
        size = first.setdefault("batch_size", len(images))
        return cell(Tensor(padded_to(images, size))).asnumpy()[:len(images)]

    with weights_frozen(net):  # an evaluation never changes them: our layers reorder them once, not per batch
        return predictor_sums(run, dataset, metrics, group_size=group_size)


EVAL_CELLS = "_evaluation_cells"  # where a network keeps its evaluation cells


def eval_cell(net: nn.Cell, normalization) -> nn.Cell:
    """`net` (after the input stage for uint8 batches) as evaluation runs it, built once per
    network and normalization: MindSpore compiles a graph per cell object, so a new cell for every
    evaluation compiled its graph again each epoch. The cells live on the network (set past Cell's
    attribute hook, so they are no sub-cells of it) and go with it."""
    cells = net.__dict__.get(EVAL_CELLS)
    if cells is None:
        cells = {}
        object.__setattr__(net, EVAL_CELLS, cells)
    if normalization not in cells:
        cells[normalization] = WithInputStage(net, normalization) if normalization is not None else net
    return cells[normalization]


def predictor_sums(run: Callable[[np.ndarray], np.ndarray], dataset, metrics: Dict[str, Metric], *,
                   group_size: int = 1) -> Dict[str, np.ndarray]:
    """`evaluate_sums` for a model given as a function from an image batch to its logits (an
    exported file); each metric takes the batches through its `add(logits, labels)`."""
    for metric in metrics.values():
        metric.clear()
    for images, labels in dataset.create_tuple_iterator(output_numpy=True, num_epochs=1):
        logits = run(images)
        for metric in metrics.values():
            metric.add(logits, labels)
    return sum_over_ranks({name: metric.eval() for name, metric in metrics.items()}, group_size)


def sum_over_ranks(sums: Dict[str, np.ndarray], group_size: int) -> Dict[str, np.ndarray]:
    """The metrics' vectors summed over all ranks in one allreduce (unchanged for one process)."""
    if group_size <= 1:
        return sums
    names = list(sums)
    joined = all_reduce_sum(np.concatenate([np.asarray(sums[name], np.float64) for name in names]))
    return dict(zip(names, np.split(joined, np.cumsum([np.size(sums[name]) for name in names])[:-1])))


def evaluate(net: nn.Cell, dataset, *, group_size: int = 1) -> Dict[str, float]:
    """Evaluate `net` over this rank's shard of `dataset`; with several ranks, the counts of all
    shards are summed so every rank returns the same numbers for the whole split."""
    return summarize(evaluate_sums(net, dataset, {"counts": ClassificationCounts()}, group_size=group_size)["counts"])


def evaluate_outputs(run: Callable[[np.ndarray], np.ndarray], dataset, *, group_size: int = 1) -> Dict[str, float]:
    """`evaluate` for a model given as a function from an image batch to its logits (an exported file)."""
    return summarize(predictor_sums(run, dataset, {"counts": ClassificationCounts()}, group_size=group_size)["counts"])


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)
