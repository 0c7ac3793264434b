"""The launchers and entry points as a user runs them: real subprocesses on generated data."""
import math
import shutil
from pathlib import Path

import pytest

from conftest import PYTHON, REPO, last_json, read_metrics, run

pytestmark = pytest.mark.slow  # trains, exports or starts processes: not in the quick tier

CONFIG = REPO / "config" / "sample_resnet18.yaml"
TRAIN_SH = REPO / "scripts" / "run_standalone_train.sh"
EVAL_SH = REPO / "scripts" / "run_eval.sh"
FAST = ["--epoch_size", "3", "--batch_size", "16", "--warmup_epochs", "0", "--lr_max", "0.05",
        "--log_interval", "4"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A working directory outside the repo whose path has a space in it."""
    path = tmp_path_factory.mktemp("work") / "my runs"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def cifar_run(workdir, cifar_dir) -> Path:
    """Train through run_standalone_train.sh from another directory; returns the run folder."""
    data = workdir / "cifar data"
    shutil.copytree(cifar_dir, data)
    result = run(["bash", str(TRAIN_SH), "cifar data", str(CONFIG), "--output_dir", "out"] + FAST, cwd=workdir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return workdir / "out" / "resnet18" / "cifar10"


def test_standalone_train_writes_checkpoint_config_and_log(cifar_run):
    checkpoints = sorted(cifar_run.glob("resnet18-*.ckpt"))
    assert [c.name for c in checkpoints] == ["resnet18-1_12.ckpt", "resnet18-2_12.ckpt", "resnet18-3_12.ckpt"]
    logs = list(cifar_run.glob("train_*.log"))
    assert len(logs) == 1 and "epoch 3 done" in logs[0].read_text()
    saved = (cifar_run / "config.yaml").read_text()
    assert "epoch_size: 3" in saved and "batch_size: 16" in saved


def test_run_eval_reports_accuracy_on_every_sample(cifar_run, workdir):
    ckpt = cifar_run / "resnet18-3_12.ckpt"
    result = run(["bash", str(EVAL_SH), "cifar data", str(ckpt), str(CONFIG), "--batch_size", "16"], cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    report = last_json(result.stdout)
    assert report["samples"] == 101
    assert report["checkpoint"] == str(ckpt)
    # 3 short epochs on 200 images already learn the sample classes well above chance (0.1).
    assert report["top_1_accuracy"] > 0.3
    assert report["top_1_accuracy"] <= report["top_5_accuracy"] <= 1.0
    assert list(cifar_run.glob("eval_*.log"))


def test_train_and_eval_on_image_folders(tmp_path, folder_dir):
    common = ["--config_path", str(CONFIG), "--net_name", "resnet10",  # the smallest: the data path is what is tested
              "--dataset", "imagenet2012", "--data_path", str(folder_dir), "--train_image_size", "48",
              "--eval_image_size", "48", "--output_dir", str(tmp_path),
              "--num_parallel_workers", "2", "--data_worker_kind", "thread"]
    # mixed precision (O2) with the v2 recipe's data switches: the input stage runs in float32
    # before the float16 network, erasing and mixing included
    recipe = ["--amp_level", "O2", "--auto_augment", "ta_wide", "--random_erase", "0.5", "--mixup_alpha", "0.2",
              "--cutmix_alpha", "1.0"]
    trained = run([PYTHON, "train.py"] + common + FAST + ["--epoch_size", "1"] + recipe)
    assert trained.returncode == 0, trained.stderr[-3000:]
    losses = [float(row["loss"]) for row in read_metrics(tmp_path / "resnet10" / "imagenet2012") if row["loss"]]
    assert losses and all(math.isfinite(loss) for loss in losses)
    ckpt = tmp_path / "resnet10" / "imagenet2012" / "resnet10-1_12.ckpt"
    evaluated = run([PYTHON, "eval.py"] + common + ["--checkpoint_file_path", str(ckpt), "--batch_size", "32"])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    report = last_json(evaluated.stdout)
    assert report["samples"] == 101 and 0.0 <= report["top_1_accuracy"] <= 1.0


def test_eval_rejects_checkpoint_of_another_shape(cifar_run, cifar_dir):
    ckpt = cifar_run / "resnet18-1_12.ckpt"
    result = run([PYTHON, "eval.py", "--config_path", str(CONFIG), "--data_path", str(cifar_dir),
                  "--class_num", "12", "--checkpoint_file_path", str(ckpt)])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "fc.weight" in lines[0] and str(ckpt) in lines[0]


@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all" * 10])
def test_eval_rejects_corrupt_checkpoint(tmp_path, cifar_dir, content):
    ckpt = tmp_path / "broken.ckpt"
    ckpt.write_bytes(content)
    result = run([PYTHON, "eval.py", "--config_path", str(CONFIG), "--data_path", str(cifar_dir),
                  "--checkpoint_file_path", str(ckpt)])
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and str(ckpt) in result.stderr


def test_bad_inputs_fail_before_writing_anything(tmp_path, cifar_dir):
    out = tmp_path / "out"
    cases = [
        ["bash", str(TRAIN_SH), str(tmp_path / "missing"), str(CONFIG), "--output_dir", str(out)],
        ["bash", str(TRAIN_SH), str(cifar_dir), str(CONFIG), "--output_dir", str(out), "--lr_mx", "1"],
        ["bash", str(TRAIN_SH), str(cifar_dir), str(CONFIG), "--output_dir", str(out), "--epoch_size", "x"],
        ["bash", str(TRAIN_SH), str(cifar_dir), str(tmp_path / "nope.yaml")],
        [PYTHON, "train.py", "--config_path", str(CONFIG), "--data_path", str(cifar_dir),
         "--output_dir", str(out), "--device_target", "Ascend"],
    ]
    for args in cases:
        result = run(args)
        assert result.returncode != 0, args
        assert len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)
        assert result.stderr.startswith("error: ")
    assert not out.exists()


def test_scripts_print_help():
    for script in (TRAIN_SH, EVAL_SH):
        result = run(["bash", str(script), "--help"])
        assert result.returncode == 0 and result.stdout.startswith("usage:")
