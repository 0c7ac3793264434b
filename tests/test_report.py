"""The evaluation report and the model summary: hand-built predictions with known answers, the
pictures, a real training run's report, eval.py --report_dir alone and across two msrun ranks."""
import csv
import json
import os
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from PIL import Image

from conftest import PYTHON, REPO, run
from src.data.sources import CifarBinarySource
from src.evaluation.metrics import ClassificationCounts
from src.evaluation.model_summary import model_summary
from src.evaluation.report import EvalReport, ReportCounts, per_class_rows, report_lines, write_report
from src.resnet import create_model

pytestmark = pytest.mark.slow  # trains, exports or starts processes: not in the quick tier

CONFIG = str(REPO / "config" / "sample_resnet18.yaml")
NET = "resnet10"  # the smallest of the family: what a report holds does not depend on depth


def report_of(logits, labels, batches=((None, None),), total=0) -> EvalReport:
    """The report of (logits, labels) fed in batches; each batch may name its samples' global indices."""
    logits, labels = np.asarray(logits, np.float32), np.asarray(labels, np.int32)
    num_classes = logits.shape[1]
    sums = 0
    for rows, indices in batches:
        rows = slice(None) if rows is None else rows
        metric = ReportCounts(num_classes, sample_indices=indices, total=total)
        metric.update(ms.Tensor(logits[rows]), ms.Tensor(labels[rows]))
        sums = sums + metric.eval()
    return EvalReport.from_sums(sums, num_classes, total)


def probabilities_as_logits(rows):
    return np.log(np.asarray(rows, np.float64))


def test_per_class_figures_and_ece_on_known_predictions():
    # class 0: 2 of 3 right (one taken for class 2); class 1: 0 of 1 (taken for 0); class 2: 1 of 1
    probabilities = [[0.9, 0.05, 0.05], [0.6, 0.3, 0.1], [0.2, 0.1, 0.7], [0.5, 0.4, 0.1], [0.1, 0.2, 0.7]]
    labels = [0, 0, 0, 1, 2]
    report = report_of(probabilities_as_logits(probabilities), labels)
    rows = per_class_rows(report, ["a", "b", "c"])
    assert [(r["class"], r["samples"], r["top1"], r["mistaken_for"], r["mistaken_times"]) for r in rows] == [
        ("a", 3, 2 / 3, "c", 1), ("b", 1, 0.0, "a", 1), ("c", 1, 1.0, "", 0)]
    assert [r["top5"] for r in rows] == [1.0, 1.0, 1.0]  # 3 classes: everything is in the top 5
    # bins of 1/15: 0.9 (right), 0.6 (right), 0.7 (wrong), 0.5 (wrong), 0.7 (right)
    expected_ece = (abs(1 - 0.9) + abs(1 - 0.6) + abs(1 - 0.7 - 0.7) + abs(0 - 0.5)) / 5
    assert report.ece() == pytest.approx(expected_ece, abs=1e-6)
    assert report.worst_classes(5) == [1, 0, 2]
    assert report.most_confused(5) == [(0, 2, 1), (1, 0, 1)]
    assert report_lines(report, ["a", "b", "c"]) == [
        "worst classes (top-1, samples): b 0.000 (1), a 0.667 (3), c 1.000 (1)",
        "most confused (true -> predicted, count): a -> c 1, b -> a 1"]


def test_perfectly_calibrated_predictions_have_zero_ece():
    # 10 samples at confidence 0.8, 8 of them right
    logits = probabilities_as_logits([[0.8, 0.2]] * 10)
    report = report_of(logits, [0] * 8 + [1] * 2)
    assert report.ece() == pytest.approx(0.0, abs=1e-6)


def test_confusion_sums_to_samples_and_its_diagonal_to_top1():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 7)).astype(np.float32)
    logits[:3, 2] = logits[:3, 5] = 9.0  # ties go to the lower index, as argmax and top-1 count them
    labels = rng.integers(0, 7, size=64)
    report = report_of(logits, labels)
    counts = ClassificationCounts()
    counts.update(ms.Tensor(logits), ms.Tensor(labels.astype(np.int32)))
    top1, top5, _, samples = counts.eval()
    assert report.confusion.sum() == samples == 64
    assert report.correct.sum() == top1
    assert report.top5.sum() == top5
    assert report.samples.tolist() == np.bincount(labels, minlength=7).tolist()


def test_non_finite_outputs_count_as_samples_but_never_as_predictions():
    logits = np.array([[np.nan, 0.0], [2.0, 0.0], [np.inf, 0.0]])
    report = report_of(logits, [0, 0, 1])
    assert report.samples.tolist() == [2, 1]
    assert report.confusion.sum() == 1 and report.nonfinite.tolist() == [1, 1]
    assert report.bins[:, 0].sum() == 1


def test_shards_filled_at_their_global_rows_sum_to_the_whole_table():
    rng = np.random.default_rng(1)
    logits, labels = rng.normal(size=(9, 6)), rng.integers(0, 6, size=9)
    whole = report_of(logits, labels, batches=[(None, np.arange(9))], total=9)
    # two shards as create_eval_dataset cuts them: rank r takes samples r, r + 2, ...
    split = report_of(logits, labels, batches=[(slice(0, None, 2), np.arange(0, 9, 2)),
                                               (slice(1, None, 2), np.arange(1, 9, 2))], total=9)
    np.testing.assert_array_equal(split.predictions, whole.predictions)
    np.testing.assert_array_equal(split.confusion, whole.confusion)
    assert whole.predictions[:, 0].tolist() == labels.tolist()
    top = np.argsort(-logits, axis=1, kind="stable")[:, :5]
    assert whole.predictions[:, 1:6].tolist() == top.tolist()
    assert np.all(np.diff(whole.predictions[:, 6:], axis=1) <= 0)  # probabilities, most probable first


def decoded_size(path: Path):
    with Image.open(path) as image:
        image.load()
        return image.size


def test_pictures_are_written_and_decode(tmp_path):
    rng = np.random.default_rng(2)
    few = report_of(rng.normal(size=(40, 4)), rng.integers(0, 4, size=40))
    files = write_report(str(tmp_path / "few"), few, ["w", "x", "y", "z"], title="unit test")
    assert sorted(Path(f).name for f in files) == ["calibration.png", "confusion.csv", "confusion.png",
                                                   "per_class.csv"]
    many = report_of(rng.normal(size=(300, 120)), rng.integers(0, 120, size=300))
    files = write_report(str(tmp_path / "many"), many, [f"c{i}" for i in range(120)], title="unit test")
    assert "confusions.png" in {Path(f).name for f in files} and not (tmp_path / "many" / "confusion.png").exists()
    for picture in list((tmp_path / "few").glob("*.png")) + list((tmp_path / "many").glob("*.png")):
        width, height = decoded_size(picture)
        assert width >= 400 and height >= 300
    assert not [p for p in tmp_path.rglob(".tmp-*")]


@pytest.mark.parametrize("net_name, image_size, gflops, trainable", [
    ("resnet18", 224, 1.81, 11_689_512), ("resnet50", 224, 4.09, 25_557_032)])
def test_gflops_and_parameters_match_torchvisions_published_figures(net_name, image_size, gflops, trainable):
    summary = model_summary(create_model(net_name, num_classes=1000, initialize=False), image_size=image_size)
    assert round(summary["gflops"], 2) == gflops
    assert summary["trainable_parameters"] == trainable
    assert summary["checkpoint_mb"] == pytest.approx(summary["parameters"] * 4 / 2**20, abs=0.01)


def test_gflops_follow_the_image_size():
    net = create_model("resnet18", num_classes=10)
    at_32, at_64 = (model_summary(net, image_size=s)["gflops"] for s in (32, 64))
    assert at_64 == pytest.approx(4 * at_32, rel=0.02)  # the stride-2 stages halve exactly from 64 px


def read_csv(path: Path):
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.reader(handle))


def test_training_logs_the_summary_and_writes_the_best_checkpoints_report(sample_run):
    folder, stdout = sample_run
    lines = stdout.splitlines()
    (summary,) = [line for line in lines if line.startswith(f"model {NET}:")]
    assert lines.index(summary) < min(i for i, line in enumerate(lines) if line.startswith("epoch 1 "))
    assert "4,910,922 trainable parameters" in summary and "0.0181 GFLOPs per image at 32 px" in summary
    report = folder / "report"
    assert sorted(p.name for p in report.iterdir()) == ["calibration.png", "confusion.csv", "confusion.png",
                                                        "per_class.csv"]
    rows = read_csv(report / "per_class.csv")
    assert rows[0] == ["class", "samples", "top1", "top5", "mistaken_for", "mistaken_times"]
    assert sum(int(r[1]) for r in rows[1:]) == 101
    best_line = [line for line in lines if "new best top-1" in line][-1]
    best_top1 = float(best_line.split("top-1 ")[1].split(",")[0])
    confusion = np.array([[int(v) for v in r[1:]] for r in read_csv(report / "confusion.csv")[1:]])
    assert round(np.trace(confusion) / 101, 4) == best_top1


def eval_args(folder: Path, cifar_dir, report_dir: Path):
    return ["--config_path", CONFIG, "--net_name", NET, "--data_path", str(cifar_dir), "--checkpoint_file_path",
            str(folder / "best.ckpt"), "--batch_size", "16", "--report_dir", str(report_dir),
            "--save_predictions", "True"]


def json_line(lines):
    return json.loads([line for line in lines if line.startswith("{")][-1])


def test_eval_report_dir_writes_every_file(sample_run, cifar_dir, tmp_path):
    folder, _ = sample_run
    result = run([PYTHON, "eval.py", *eval_args(folder, cifar_dir, tmp_path / "r"), "--summary", "True"])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    figures = json_line(lines)
    assert figures["samples"] == 101 and 0.0 <= figures["ece"] <= 1.0
    assert lines[-2].startswith("worst classes") and lines[-1].startswith("most confused")
    summary = [line for line in lines if line.startswith(f"model {NET}:")]
    size_mib = os.path.getsize(folder / "best.ckpt") / 2**20
    assert summary and f"checkpoint {size_mib:.1f} MiB" in summary[0]
    predictions = read_csv(tmp_path / "r" / "predictions.csv")
    assert predictions[0][:4] == ["sample", "label", "class_1", "probability_1"] and len(predictions) == 102
    source = CifarBinarySource(str(cifar_dir), training=False)
    assert [r[0] for r in predictions[1:]] == [str(i) for i in range(101)]
    assert [r[1] for r in predictions[1:]] == [source.class_names[label] for label in source.labels]
    top1 = np.mean([r[1] == r[2] for r in predictions[1:]])
    assert top1 == pytest.approx(figures["top_1_accuracy"])
    per_class = read_csv(tmp_path / "r" / "per_class.csv")
    assert [r[0] for r in per_class[1:]] == source.class_names  # the sample data's batches.meta.txt
    # the training's report of best.ckpt (kept from the epoch that saved it, not evaluated again)
    for name in ("per_class.csv", "confusion.csv"):
        assert (folder / "report" / name).read_text() == (tmp_path / "r" / name).read_text(), name


def test_two_rank_report_equals_the_one_process_report(sample_run, cifar_dir, tmp_path):
    folder, _ = sample_run
    single = run([PYTHON, "eval.py", *eval_args(folder, cifar_dir, tmp_path / "one")])
    assert single.returncode == 0, single.stderr[-2000:]
    logs = tmp_path / "logs"
    launched = run([str(Path(PYTHON).parent / "msrun"), "--worker_num=2", "--local_worker_num=2",
                    "--master_port=8231", f"--log_dir={logs}", "--join=True", str(REPO / "eval.py"),
                    *eval_args(folder, cifar_dir, tmp_path / "two"), "--run_distribute", "True", "--device_num", "2"],
                   env=dict(os.environ, PATH=f"{Path(PYTHON).parent}:{os.environ['PATH']}"))  # msrun runs `python`
    assert launched.returncode == 0, launched.stdout[-2000:]
    for name in ("per_class.csv", "confusion.csv"):
        assert (tmp_path / "two" / name).read_text() == (tmp_path / "one" / name).read_text(), name
    one, two = (read_csv(tmp_path / folder / "predictions.csv") for folder in ("one", "two"))
    assert len(one) == len(two) == 102
    names = [i for i, column in enumerate(one[0]) if not column.startswith("probability")]
    assert [[row[i] for i in names] for row in two] == [[row[i] for i in names] for row in one]
    # A sample's logits differ in the last bits with the batch it is computed in (each rank batches
    # its own shard), so the probabilities agree to float precision, not to the bit.
    probability = [i for i in range(len(one[0])) if i not in names]
    np.testing.assert_allclose([[float(row[i]) for i in probability] for row in two[1:]],
                               [[float(row[i]) for i in probability] for row in one[1:]], rtol=1e-3, atol=1e-6)
    expected = json_line(single.stdout.splitlines())
    for rank in (0, 1):
        reported = json_line((logs / f"worker_{rank}.log").read_text().splitlines())
        assert reported["samples"] == 101  # every sample counted once across the ranks
        assert reported["top_1_accuracy"] == expected["top_1_accuracy"]
        assert reported["top_5_accuracy"] == expected["top_5_accuracy"]
        assert reported["loss"] == pytest.approx(expected["loss"], abs=1e-5)
        assert reported["ece"] == pytest.approx(expected["ece"], abs=1e-6)


def test_save_predictions_without_report_dir_is_one_error_line(tmp_path, cifar_dir):
    result = run([PYTHON, "eval.py", "--config_path", CONFIG, "--data_path", str(cifar_dir),
                  "--checkpoint_file_path", str(tmp_path / "any.ckpt"), "--save_predictions", "True"])
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "--report_dir" in result.stderr
