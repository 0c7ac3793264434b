"""One short training through the launcher, its checkpoint evaluated and exported (MINDIR and ONNX,
verified against the checkpoint): the whole user path at the smallest size, cheap enough for the
emulated arm64 machine's tier (docs/aarch64.md)."""
from pathlib import Path

import pytest

from conftest import NO_CURVES, PYTHON, REPO, last_json, run
from src.training.checkpoint import read_checkpoint

pytestmark = pytest.mark.slow  # trains, exports or starts processes: not in the quick tier

CONFIG = REPO / "config" / "sample_resnet18.yaml"
# resnet10 on 32 images at 32 px, two steps of 16, PYNATIVE: no graph to compile (minutes under emulation).
SHORT = ["--config_path", str(CONFIG), "--net_name", "resnet10", "--batch_size", "16", "--epoch_size", "1",
         "--warmup_epochs", "0", "--lr_max", "0.01", "--mode_name", "PYNATIVE", *NO_CURVES]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    from src.data.sample_data import write_sample_data
    root = tmp_path_factory.mktemp("short")
    write_sample_data(str(root / "data"), train_per_class=3, test_per_class=2, seed=4, formats=("cifar10",))
    data = root / "data" / "cifar10"
    result = run(["bash", str(REPO / "scripts" / "run_standalone_train.sh"), str(data), str(CONFIG),
                  "--output_dir", str(root / "out"), *SHORT[2:], "--run_eval", "False"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root, data, root / "out" / "resnet10" / "cifar10" / "resnet10-1_1.ckpt"


def test_the_checkpoint_holds_the_trained_network(short_run):
    _, _, checkpoint = short_run
    stored = read_checkpoint(str(checkpoint))
    assert "fc.weight" in stored and stored["fc.weight"].shape == (10, 512)


def test_the_checkpoint_evaluates_on_every_sample(short_run):
    _, data, checkpoint = short_run
    result = run([PYTHON, "eval.py", *SHORT, "--data_path", str(data), "--checkpoint_file_path", str(checkpoint)])
    assert result.returncode == 0, result.stderr[-3000:]
    report = last_json(result.stdout)
    assert report["samples"] == 20 and 0.0 <= report["top_1_accuracy"] <= 1.0


@pytest.mark.parametrize("file_format", ["MINDIR", "ONNX"])
def test_the_checkpoint_exports_and_the_file_computes_as_it_does(short_run, file_format):
    root, _, checkpoint = short_run
    name = root / "exported" / f"resnet10-{file_format.lower()}"
    result = run([PYTHON, "export.py", *SHORT[:4], "--checkpoint_file_path", str(checkpoint), "--file_format",
                  file_format, "--file_name", str(name), "--batch_size", "4", "--eval_image_size", "32", "--verify"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = last_json(result.stdout)
    assert report["verified"] is True and report["max_abs_diff"] <= 1e-4
    assert Path(report["path"]).is_file()
