"""The evaluation report: per-class accuracy, the confusion matrix, calibration and per-image results.

Each rank counts its own samples into one vector of sums (confusion matrix, top-5 hits, calibration
bins and, when asked, a row per sample at its global index, zeros elsewhere); summing the vectors
over ranks gives exactly the one-process report, with no sample counted twice or lost.
"""
import csv
import io
import os
import textwrap
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mindspore import nn
from mindspore.train import Metric

from src.evaluation.metrics import (
    ClassificationCounts,
    evaluate_sums,
    predictor_sums,
    softmax,
    summarize,
    true_class_rank,
)
from src.files import atomic_target, write_atomic

CALIBRATION_BINS = 15
TOP_K = 5
HEATMAP_MAX_CLASSES = 100   # above this, confusions.png shows the most confused pairs instead
CONFUSED_PAIRS_PLOTTED = 30
CONSOLE_ROWS = 5


def calibration_bin(confidence: np.ndarray, bins: int = CALIBRATION_BINS) -> np.ndarray:
    """The bin of each confidence among `bins` equal bins of (0, 1]: (0, 1/b], (1/b, 2/b], ..."""
    return np.clip(np.ceil(confidence * bins).astype(np.int64) - 1, 0, bins - 1)


class ReportCounts(Metric):
    """Sums for the report over the samples this rank evaluates, as one float64 vector.

    `sample_indices` are the global indices of this rank's samples in the order the dataset yields
    them and `total` the samples of the whole split; with them, each sample's label, top-k classes
    and probabilities are kept in its own row of a (total x (1 + 2k)) table."""

    def __init__(self, num_classes: int, *, sample_indices: Optional[np.ndarray] = None, total: int = 0):
        super().__init__()
        self.num_classes = num_classes
        self.k = min(TOP_K, num_classes)
        self.sample_indices, self.total = sample_indices, total
        self.clear()

    def clear(self) -> None:
        classes = self.num_classes
        self.confusion = np.zeros((classes, classes))
        self.top5 = np.zeros(classes)
        self.nonfinite = np.zeros(classes)
        self.bins = np.zeros((CALIBRATION_BINS, 3))  # samples, summed confidence, correct
        self.rows = np.zeros((self.total, 1 + 2 * self.k)) if self.sample_indices is not None else None
        self.seen = 0

    def update(self, *inputs) -> None:
        self.add(inputs[0].asnumpy(), inputs[1].asnumpy())

    def add(self, logits: np.ndarray, labels: np.ndarray) -> None:
        """Count one batch of logits [batch, classes] against its integer labels."""
        logits = logits.astype(np.float64)
        labels = labels.astype(np.int64)
        finite = np.isfinite(logits).all(axis=1)
        np.add.at(self.nonfinite, labels[~finite], 1)
        np.add.at(self.top5, labels, true_class_rank(logits, labels) < 5)
        with np.errstate(invalid="ignore"):  # NaN/Inf rows: counted above, never predicted
            probabilities = softmax(logits)
        predicted = logits.argmax(axis=1)
        np.add.at(self.confusion, (labels[finite], predicted[finite]), 1)
        confidence = probabilities.max(axis=1)[finite]
        correct = (predicted == labels)[finite]
        where = calibration_bin(confidence)
        np.add.at(self.bins, (where, 0), 1)
        np.add.at(self.bins, (where, 1), confidence)
        np.add.at(self.bins, (where, 2), correct)
        if self.rows is not None:
            order = np.argsort(-probabilities, axis=1, kind="stable")[:, :self.k]
            # float32 without subnormals, as the cross-rank sum carries them (it flushes those to 0),
            # so the same logits give the same file from one process or from N ranks
            chosen = np.take_along_axis(probabilities, order, axis=1).astype(np.float32)
            chosen[chosen < np.finfo(np.float32).tiny] = 0.0
            indices = self.sample_indices[self.seen:self.seen + len(labels)]
            self.rows[indices] = np.concatenate([labels[:, None], order, chosen], axis=1)
        self.seen += len(labels)

    def eval(self) -> np.ndarray:
        parts = [self.confusion.ravel(), self.top5, self.nonfinite, self.bins.ravel()]
        return np.concatenate(parts + ([self.rows.ravel()] if self.rows is not None else []))


@dataclass
class EvalReport:
    """The summed counts of a whole split (`predictions` only when kept)."""
    confusion: np.ndarray          # [true class, predicted class] counts (finite outputs)
    top5: np.ndarray               # per class: samples whose class is within the top 5
    nonfinite: np.ndarray          # per class: samples with a NaN/Inf output (no prediction)
    bins: np.ndarray               # per calibration bin: samples, summed confidence, correct
    predictions: Optional[np.ndarray] = None  # per sample: label, top-k classes, their probabilities

    @classmethod
    def from_sums(cls, sums: np.ndarray, num_classes: int, total: int = 0) -> "EvalReport":
        """Split ReportCounts' vector (summed over ranks) back into its parts."""
        sizes = [num_classes * num_classes, num_classes, num_classes, CALIBRATION_BINS * 3]
        parts = np.split(sums, np.cumsum(sizes))
        confusion, top5, nonfinite, bins, rest = parts
        k = min(TOP_K, num_classes)
        return cls(confusion=np.rint(confusion).astype(np.int64).reshape(num_classes, num_classes),
                   top5=np.rint(top5).astype(np.int64), nonfinite=np.rint(nonfinite).astype(np.int64),
                   bins=bins.reshape(CALIBRATION_BINS, 3),
                   predictions=rest.reshape(total, 1 + 2 * k) if rest.size else None)

    @property
    def samples(self) -> np.ndarray:
        """Per class: the samples evaluated."""
        return self.confusion.sum(axis=1) + self.nonfinite

    @property
    def correct(self) -> np.ndarray:
        return np.diag(self.confusion)

    def ece(self) -> float:
        """Expected calibration error: the sample-weighted mean |accuracy - confidence| over the bins."""
        count = self.bins[:, 0].sum()
        return float(np.abs(self.bins[:, 2] - self.bins[:, 1]).sum() / max(count, 1.0))

    def most_confused(self, limit: int) -> List[Tuple[int, int, int]]:
        """The (true, predicted, count) pairs off the diagonal, most frequent first (ties: by index)."""
        off = self.confusion.copy()
        np.fill_diagonal(off, 0)
        flat = np.argsort(-off.ravel(), kind="stable")[:limit]
        pairs = [(int(i) // off.shape[1], int(i) % off.shape[1]) for i in flat]
        return [(t, p, int(off[t, p])) for t, p in pairs if off[t, p] > 0]

    def worst_classes(self, limit: int) -> List[int]:
        """Classes with samples, lowest top-1 first (ties: by index)."""
        present = np.flatnonzero(self.samples)
        accuracy = self.correct[present] / self.samples[present]
        return [int(present[i]) for i in np.argsort(accuracy, kind="stable")[:limit]]


def evaluate_with_report(net: Optional[nn.Cell], dataset, *, num_classes: int, group_size: int = 1,
                         keep_predictions: bool = False,
                         run: Optional[Callable[[np.ndarray], np.ndarray]] = None) -> Tuple[Dict, EvalReport]:
    """evaluate()'s figures plus `ece`, and the report of the whole split, in one pass over this
    rank's shard of `dataset` (a dataset of create_dataset: its sampler gives the global indices).
    The model is `net`, or `run` (image batch -> logits) for an exported file."""
    sampler = dataset.epoch_sampler
    total = sampler.total if keep_predictions else 0
    details = ReportCounts(num_classes, total=total,
                           sample_indices=sampler.epoch_indices(0) if keep_predictions else None)
    metrics = {"counts": ClassificationCounts(), "report": details}
    if run is not None:
        sums = predictor_sums(run, dataset, metrics, group_size=group_size)
    else:
        sums = evaluate_sums(net, dataset, metrics, group_size=group_size)
    report = EvalReport.from_sums(sums["report"], num_classes, total)
    return {**summarize(sums["counts"]), "ece": report.ece()}, report


def class_names_for(source, num_classes: int) -> List[str]:
    """The source's class names (folder names, CIFAR-10's names), one per class of the network."""
    names = list(getattr(source, "class_names", []))[:num_classes]
    return names + [f"class {i}" for i in range(len(names), num_classes)]


def save_report(folder: str, report: EvalReport, *, source, num_classes: int, title: str,
                log: Callable[[str], None] = print, pictures: bool = True) -> List[str]:
    """Write the report's files into `folder` (names from the dataset's `source`; `pictures` False:
    the tables only) and log the worst classes and the most confused pairs; returns the files written."""
    names = class_names_for(source, num_classes)
    written = write_report(folder, report, names, title=title, sample_names=getattr(source, "paths", None),
                           pictures=pictures)
    for line in report_lines(report, names):
        log(line)
    return written


def per_class_rows(report: EvalReport, class_names: Sequence[str]) -> List[Dict]:
    """One row per class: samples, top-1, top-5 and its most frequent wrong prediction."""
    rows = []
    for index, name in enumerate(class_names):
        samples = int(report.samples[index])
        wrong = report.confusion[index].copy()
        wrong[index] = 0
        mistaken = int(wrong.argmax()) if wrong.max() > 0 else None
        rows.append({"class": name, "samples": samples,
                     "top1": report.correct[index] / samples if samples else float("nan"),
                     "top5": report.top5[index] / samples if samples else float("nan"),
                     "mistaken_for": class_names[mistaken] if mistaken is not None else "",
                     "mistaken_times": int(wrong.max())})
    return rows


def report_lines(report: EvalReport, class_names: Sequence[str]) -> List[str]:
    """The five worst classes and the five most confused pairs."""
    rows = per_class_rows(report, class_names)
    worst = ", ".join(f"{rows[i]['class']} {rows[i]['top1']:.3f} ({rows[i]['samples']})"
                      for i in report.worst_classes(CONSOLE_ROWS))
    pairs = ", ".join(f"{class_names[t]} -> {class_names[p]} {n}" for t, p, n in report.most_confused(CONSOLE_ROWS))
    return [f"worst classes (top-1, samples): {worst}", f"most confused (true -> predicted, count): {pairs or 'none'}"]


def _csv_text(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buffer.getvalue()


def _number(value: float) -> str:
    return f"{value:.6g}"


def write_report(folder: str, report: EvalReport, class_names: Sequence[str], *, title: str,
                 sample_names: Optional[Sequence[str]] = None, pictures: bool = True) -> List[str]:
    """Write per_class.csv, confusion.csv, the confusion and calibration pictures (unless `pictures`
    is False: matplotlib's import and two figures cost about a second and a half) and, when the
    report holds them, predictions.csv into `folder`; returns the files written."""
    written = []

    def put(name: str, text: str) -> None:
        write_atomic(os.path.join(folder, name), text)
        written.append(os.path.join(folder, name))

    rows = per_class_rows(report, class_names)
    columns = list(rows[0])
    put("per_class.csv", _csv_text(columns, [[_number(r[c]) if isinstance(r[c], float) else r[c] for c in columns]
                                             for r in rows]))
    nonfinite = report.nonfinite.any()
    put("confusion.csv", _csv_text(["true \\ predicted", *class_names] + (["non-finite output"] if nonfinite else []),
                                   [[name, *counts] + ([int(report.nonfinite[i])] if nonfinite else [])
                                    for i, (name, counts) in enumerate(zip(class_names, report.confusion.tolist()))]))
    if report.predictions is not None:
        put("predictions.csv", predictions_csv(report.predictions, class_names, sample_names))
    if not pictures:
        return written
    import matplotlib
    matplotlib.use("Agg")
    if len(class_names) <= HEATMAP_MAX_CLASSES:
        written.append(_save(plot_confusion(report, class_names, title), os.path.join(folder, "confusion.png")))
    else:
        written.append(_save(plot_confused_pairs(report, class_names, title), os.path.join(folder, "confusions.png")))
    written.append(_save(plot_calibration(report, title), os.path.join(folder, "calibration.png")))
    return written


def predictions_csv(table: np.ndarray, class_names: Sequence[str], sample_names: Optional[Sequence[str]]) -> str:
    """One row per sample: its file (or record index), the label and the top-k classes with probabilities."""
    k = (table.shape[1] - 1) // 2
    header = ["sample", "label"] + [f"{what}_{i}" for i in range(1, k + 1) for what in ("class", "probability")]
    rows = []
    for index, row in enumerate(table):
        classes, probabilities = row[1:1 + k].astype(np.int64), row[1 + k:]
        ranked = [value for c, p in zip(classes, probabilities) for value in (class_names[c], _number(p))]
        rows.append([sample_names[index] if sample_names is not None else index,
                     class_names[int(row[0])]] + ranked)
    return _csv_text(header, rows)


def _wrap(title: str, width: int = 60) -> str:
    """A long run name over several lines, so it fits the narrowest picture."""
    return "\n".join(textwrap.wrap(title, width, break_long_words=True, break_on_hyphens=False))


def _save(figure, path: str) -> str:
    import matplotlib.pyplot as plt
    try:
        figure.tight_layout()
        with atomic_target(path) as tmp:
            figure.savefig(tmp, dpi=100, format="png")
    finally:
        plt.close(figure)
    return path


def plot_confusion(report: EvalReport, class_names: Sequence[str], title: str):
    """The row-normalized confusion matrix as a heat map, class names on both axes."""
    import matplotlib.pyplot as plt
    classes = len(class_names)
    rows = report.confusion / np.maximum(report.confusion.sum(axis=1, keepdims=True), 1)
    side = min(4 + 0.35 * classes, 30)
    figure, axis = plt.subplots(figsize=(side + 1.5, side))
    image = axis.imshow(rows, cmap="Blues", vmin=0, vmax=1)
    figure.colorbar(image, ax=axis, fraction=0.046, pad=0.04, label="fraction of the true class")
    font = max(4, 10 - classes // 12)
    axis.set_xticks(range(classes), labels=class_names, rotation=90, fontsize=font)
    axis.set_yticks(range(classes), labels=class_names, fontsize=font)
    if classes <= 20:  # the fractions themselves are readable at this size
        for t in range(classes):
            for p in range(classes):
                if report.confusion[t, p]:
                    axis.text(p, t, f"{rows[t, p]:.2f}", ha="center", va="center", fontsize=7,
                              color="white" if rows[t, p] > 0.5 else "black")
    top1 = report.correct.sum() / max(report.samples.sum(), 1)
    axis.set(xlabel="predicted class", ylabel="true class",
             title=f"{_wrap(title)}\nconfusion matrix (rows sum to 1), top-1 {top1:.4f}")
    return figure


def plot_confused_pairs(report: EvalReport, class_names: Sequence[str], title: str):
    """The most confused (true, predicted) pairs as horizontal bars (for many classes)."""
    import matplotlib.pyplot as plt
    pairs = report.most_confused(CONFUSED_PAIRS_PLOTTED)
    figure, axis = plt.subplots(figsize=(9, 1.5 + 0.3 * max(len(pairs), 1)))
    labels = [f"{class_names[t]} -> {class_names[p]}" for t, p, _ in pairs]
    axis.barh(range(len(pairs)), [n for _, _, n in pairs], color="tab:red")
    axis.set_yticks(range(len(pairs)), labels=labels, fontsize=8)
    axis.invert_yaxis()
    axis.set(xlabel="images", ylabel="true -> predicted",
             title=f"{_wrap(title)}\nthe {len(pairs)} most confused pairs of {len(class_names)} classes")
    return figure


def plot_calibration(report: EvalReport, title: str):
    """The reliability diagram: accuracy per confidence bin against the diagonal, and the bin counts."""
    import matplotlib.pyplot as plt
    count, confidence_sum, correct = report.bins.T
    edges = np.linspace(0, 1, CALIBRATION_BINS + 1)
    centers, width = (edges[:-1] + edges[1:]) / 2, 1 / CALIBRATION_BINS
    filled = count > 0
    accuracy = np.divide(correct, count, out=np.zeros_like(correct), where=filled)
    confidence = np.divide(confidence_sum, count, out=np.zeros_like(confidence_sum), where=filled)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(6, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    top.bar(centers[filled], accuracy[filled], width=width, edgecolor="black", alpha=0.8, label="accuracy in the bin")
    top.plot(centers[filled], confidence[filled], "o", color="tab:red", label="mean confidence in the bin")
    top.plot([0, 1], [0, 1], "k--", label="perfect calibration")
    top.set(ylabel="accuracy", xlim=(0, 1), ylim=(0, 1.02),
            title=f"{_wrap(title)}\nreliability diagram, {CALIBRATION_BINS} bins, ECE {report.ece():.4f}")
    top.legend(loc="upper left")
    bottom.bar(centers, count, width=width, edgecolor="black", color="tab:gray")
    bottom.set_yscale("log")  # most images sit in the top bin; the others must stay visible
    bottom.set(xlabel="confidence (top-1 probability)", ylabel="images (log scale)")
    return figure
