"""Faults a long run meets: divergence, a full disk, unreadable images; real files, real subprocesses.
The stop-signal tests sit beside the uninterrupted runs they compare with: test_resume.py (one
process) and test_distributed.py (two ranks through the launcher)."""
import contextlib
import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from mindspore import Tensor, nn
from mindspore.train.callback import RunContext
from mindspore.train.callback._callback import InternalCallbackParam
from PIL import Image

from conftest import NO_CURVES, PYTHON, REPO, one_line_error, read_metrics, run, train_args
from src.data.bad_samples import BadSampleLog, bad_sample_limit, scan_unreadable
from src.data.batches import AugmentedSource
from src.data.image_decode import crop_resize
from src.data.sampling import EpochSampler
from src.data.sources import ImageFolderSource
from src.dataset import create_dataset
from src.errors import UserInputError
from src.files import remove_stale_temporaries
from src.resnet import create_model
from src.training.callbacks import EvalMonitor
from src.training.checkpoint import NonFiniteWeightsError, non_finite_parameters, read_checkpoint, save_atomic
from src.training.faults import DivergedError, DivergenceGuard

pytestmark = pytest.mark.slow  # trains, exports or starts processes: not in the quick tier

CONFIG = str(REPO / "config" / "sample_resnet18.yaml")
NET = "resnet10"  # the smallest of the family: the faults checked here do not depend on depth
RUN = Path(NET) / "cifar10"
FOLDER_RUN = Path(NET) / "imagenet2012"
BASE = ["--config_path", CONFIG, "--net_name", NET, "--batch_size", "16", "--log_interval", "1", "--run_eval", "False",
        "--warmup_epochs", "0", "--lr_max", "0.05", "--epoch_size", "1", *NO_CURVES]


def all_finite(path: Path) -> bool:
    return all(np.isfinite(v.asnumpy()).all() for v in read_checkpoint(str(path)).values()
               if np.issubdtype(v.asnumpy().dtype, np.floating))


# --- divergence -------------------------------------------------------------------------------

def step_context(net: nn.Cell, outputs, step: int) -> RunContext:
    return RunContext(InternalCallbackParam(net_outputs=outputs, cur_step_num=step, cur_epoch_num=1,
                                            train_network=net))


def test_guard_stops_after_patience_and_ignores_skipped_overflow_steps():
    net = nn.Dense(2, 2)
    nan = Tensor(np.float32("nan"))
    scale = Tensor(np.float32(1024))
    overflow, clean = Tensor(True), Tensor(False)
    guard = DivergenceGuard(patience=3, steps_per_epoch=100, lrs=[0.1] * 100, skips_overflow=True, hints="x")
    sequence = [(nan, clean, scale), (nan, overflow, scale), (Tensor(np.float32(1.0)), clean, scale),  # reset
                (nan, clean, scale), (nan, overflow, scale), (nan, overflow, scale), (nan, clean, scale)]
    for step, outputs in enumerate(sequence, 1):
        guard.on_train_step_end(step_context(net, outputs, step))  # 2 counted, overflow steps not
    with pytest.raises(DivergedError, match=r"3 consecutive step\(s\) up to epoch 1 step 8/100 .*lr 0.1"):
        guard.on_train_step_end(step_context(net, (nan, clean, scale), 8))
    # without a dynamic scaler an overflow flag skips nothing: a bare NaN tensor counts as well
    fixed = DivergenceGuard(patience=2, steps_per_epoch=100, lrs=[0.1] * 100, skips_overflow=False, hints="x")
    fixed.on_train_step_end(step_context(net, (nan, overflow, scale), 1))
    with pytest.raises(DivergedError):
        fixed.on_train_step_end(step_context(net, nan, 2))


def test_non_finite_weights_are_never_saved(tmp_path):
    net = nn.Dense(2, 2)
    save_atomic(net, str(tmp_path / "good.ckpt"))
    net.weight.set_data(Tensor(np.array([[1, np.inf], [0, 0]], np.float32)))
    assert non_finite_parameters(net) == [net.weight.name]
    with pytest.raises(NonFiniteWeightsError, match="bad.ckpt"):
        save_atomic(net, str(tmp_path / "bad.ckpt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.ckpt"]  # no file, no temporary
    with pytest.raises(DivergedError, match="hold NaN/Inf"):
        guard = DivergenceGuard(patience=3, steps_per_epoch=4, lrs=[0.1] * 4, skips_overflow=False, hints="x")
        guard.on_train_epoch_end(step_context(net, Tensor(np.float32(1.0)), 4))


def test_evaluation_with_non_finite_loss_never_becomes_best(cifar_dir, tmp_path):
    net = create_model("resnet18", num_classes=10)
    net.fc.bias.set_data(Tensor(np.full(10, np.nan, np.float32)))
    data = create_dataset("cifar10", str(cifar_dir), training=False, batch_size=64, image_size=32)
    monitor = EvalMonitor(net=net, dataset=data, num_classes=10, group_size=1, epoch_size=1, steps_per_epoch=1,
                          best_folder=str(tmp_path), log=lambda message: None)
    monitor.on_train_epoch_end(RunContext(InternalCallbackParam(cur_epoch_num=1, batch_num=1)))
    assert not (tmp_path / "best.ckpt").exists()


def test_nan_run_stops_and_keeps_the_good_checkpoints(cifar_dir, tmp_path):
    # lr 0 at step 1, then a warmup to 1e6: finite at first, then every weight blows up.
    result = run(train_args(BASE, cifar_dir, tmp_path, "--lr_init", "0", "--lr_max", "1e6", "--warmup_epochs", "1",
                            "--epoch_size", "2", "--save_checkpoint_steps", "1", "--keep_checkpoint_max", "2"))
    assert result.returncode == 2, result.stderr[-3000:]
    line = one_line_error(result, alone=False)
    assert "training diverged" in line and "lr_max" in line and "warmup_epochs" in line
    folder = tmp_path / RUN
    saved = sorted(folder.glob("*.ckpt"))
    assert saved and all(all_finite(path) for path in saved)  # the good ones are kept, no NaN one written
    # The last logged step is the one that stopped the run (its weights held NaN/Inf): the two steps
    # before it are the checkpoints kept (keep_checkpoint_max 2), however soon the run blew up.
    stopped = int(read_metrics(folder)[-1]["step"])
    assert sorted(int(p.stem.split("_")[1]) for p in saved) == list(range(max(1, stopped - 2), stopped))
    assert not list(folder.glob(".tmp-*"))
    assert stopped < 24  # stopped, not trained to the end


def test_a_non_finite_step_is_replayed_and_its_first_non_finite_layer_named(cifar_dir, tmp_path):
    """Weights whose layer3.0.conv1 overflows float32: step 1's loss is NaN, the step is not applied,
    and the replay names the layer in the error line and in the run folder."""
    net = create_model(NET, num_classes=10)
    for param in net.get_parameters():
        if param.name == "layer3.0.conv1.weight":
            param.set_data(Tensor(np.full(param.shape, 1e38, np.float32)))
    planted = tmp_path / "planted.ckpt"
    save_atomic(net, str(planted))
    result = run(train_args(BASE, cifar_dir, tmp_path / "out", "--pre_trained", str(planted), "--nan_patience", "1",
                            "--loss_scale_type", "fixed"))
    assert result.returncode == 2, result.stderr[-3000:]
    line = one_line_error(result, alone=False)
    assert "global step 1" in line and "(not applied)" in line
    assert "replayed step 1: first non-finite output: layer3.0.conv1 from a finite input" in line
    found = json.loads((tmp_path / "out" / RUN / "nonfinite_rank0.json").read_text())
    assert found["first_layer"] == "layer3.0.conv1" and not found["non_finite_weights"]
    assert not found["non_finite_statistics"]  # the skipped step put BatchNorm's statistics back


# --- write failures ---------------------------------------------------------------------------

def test_stale_temporaries_of_our_naming_are_removed_and_nothing_else(tmp_path):
    for name in (".tmp-123-resnet18-1_12.ckpt", ".tmp-123-resnet18-1_12.tmp", ".tmp-9-metrics.csv",
                 "notes.txt", ".hidden", "resnet18-1_12.ckpt"):
        (tmp_path / name).write_text("x")
    (tmp_path / ".tmp-dir").mkdir()
    removed = remove_stale_temporaries(str(tmp_path))
    assert removed == [".tmp-123-resnet18-1_12.ckpt", ".tmp-123-resnet18-1_12.tmp", ".tmp-9-metrics.csv"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden", ".tmp-dir", "notes.txt", "resnet18-1_12.ckpt"]


@contextlib.contextmanager
def small_disk(path: Path, megabytes: int):
    """A real filesystem of `megabytes` at `path` (tmpfs; needs root and a sandbox that allows it)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()[:120]}); the unwritable-folder "
                    f"variant below covers write failures")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def grow(path: Path, megabytes: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={megabytes}m", str(path)], check=True)


def test_full_disk_during_second_checkpoint_then_resume(cifar_dir, tmp_path):
    # A resnet10 training checkpoint is 37.5 MiB: the first fits on 60 MiB, the second does not.
    with small_disk(tmp_path / "disk", 60) as disk:
        result = run(train_args(BASE, cifar_dir, disk, "--save_checkpoint_steps", "3"))
        assert result.returncode == 2, result.stderr[-3000:]
        line = one_line_error(result, alone=False)
        assert result.stderr.strip().splitlines() == [line]  # nothing else: no traceback, no framework log
        folder = disk / RUN
        assert "cannot write" in line and f"{NET}-1_6.ckpt" in line and "No space left" in line
        assert "free in" in result.stdout and "less than the last checkpoint" in result.stdout
        assert sorted(p.name for p in folder.iterdir()) == ["config.yaml", "metrics.csv", f"{NET}-1_3.ckpt",
                                                             "tensorboard"]
        assert [int(r["step"]) for r in read_metrics(folder)] == list(range(1, 7))
        read_checkpoint(str(folder / f"{NET}-1_3.ckpt"))  # intact

        grow(disk, 200)
        (folder / f".tmp-4242-{NET}-1_9.tmp").write_bytes(b"left by a killed run")
        (folder / "notes.txt").write_text("mine")
        resumed = run(train_args(BASE, cifar_dir, disk, "--resume", "True"))
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"removed 1 temporary file(s) left by an interrupted run: .tmp-4242-{NET}-1_9.tmp" in resumed.stdout
        assert "resumed from" in resumed.stdout and f"{NET}-1_3.ckpt at global step 3" in resumed.stdout
        assert sorted(p.name for p in folder.glob("*.ckpt")) == [f"{NET}-1_12.ckpt", f"{NET}-1_3.ckpt"]
        assert (folder / "notes.txt").read_text() == "mine"
        assert [int(r["step"]) for r in read_metrics(folder)] == list(range(1, 13))


def test_unwritable_run_folder_is_one_line(cifar_dir, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders; the tmpfs test above covers write failures")
    out = tmp_path / "out"
    (out / RUN).mkdir(parents=True)
    (out / RUN).chmod(0o555)
    try:
        result = run(train_args(BASE, cifar_dir, out))
    finally:
        (out / RUN).chmod(0o755)
    assert result.returncode == 2
    line = one_line_error(result, alone=False)
    assert "cannot write" in line and "config.yaml" in line


# --- unreadable samples -----------------------------------------------------------------------

def break_image(path: Path) -> None:
    """Keep the JPEG header, cut the rest: PIL opens it lazily and fails only while decoding."""
    path.write_bytes(path.read_bytes()[:400])


def test_unreadable_image_is_replaced_by_the_next_readable_one(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        for i in range(3):
            Image.new("RGB", (8, 8), (40 * i, 100 if name == "a" else 200, 0)).save(tmp_path / name / f"{i}.jpg")
    source = ImageFolderSource(str(tmp_path), training=True)
    bad = source.paths.index(str(tmp_path / "a" / "1.jpg"))
    break_image(Path(source.paths[bad]))

    def whole(image, rng, out):
        return crop_resize(image, (0, 0, 8, 8), (8, 8), out=out)

    log = BadSampleLog(str(tmp_path / "bad.tsv"), limit=1)
    samples = AugmentedSource(source, whole, augment=True, seed=0, image_size=8, bad_samples=log)
    epoch = 3
    image, label = samples[epoch * len(source) + bad]
    expected_image, expected_label = samples[epoch * len(source) + bad + 1]
    np.testing.assert_array_equal(image, expected_image)
    assert label == expected_label
    assert log.count(epoch + 1) == 1 and log.files() == [source.paths[bad]]
    assert [name for name, _ in scan_unreadable(source)] == [source.paths[bad]]
    break_image(Path(source.paths[0]))
    with pytest.raises(UserInputError, match=r"2 unreadable images, more than max_bad_samples 1: .*0\.jpg"):
        samples[0]
    assert bad_sample_limit(-1, 1_281_167) == 1282 and bad_sample_limit(-1, 200) == 1
    with pytest.raises(UserInputError, match="max_bad_samples"):
        bad_sample_limit(-2, 10)


def test_a_file_is_warned_about_once_per_run_whichever_processes_meet_it(tmp_path):
    """Data workers each hold a copy of the log: the shared file, not a per-process set, decides
    (the defect: a broken file met by two worker processes was warned about twice)."""
    record = tmp_path / "bad.tsv"
    log = BadSampleLog(str(record), limit=5)
    meet = ("import pickle, sys; log = pickle.loads(sys.stdin.buffer.read()); "
            "log.add(int(sys.argv[1]), 7, 'broken.jpg', 'truncated'); log.add(int(sys.argv[1]), 9, 'other.jpg', 'bad')")
    warnings = []
    for epoch in (0, 1, 1):  # three processes, as two epochs' workers would
        result = subprocess.run([PYTHON, "-c", meet, str(epoch)], input=pickle.dumps(log), capture_output=True,
                                cwd=REPO)
        assert result.returncode == 0, result.stderr.decode()[-2000:]
        warnings += [line for line in result.stderr.decode().splitlines() if line.startswith("warning: skipped")]
    assert [line.split()[4] for line in warnings] == ["broken.jpg", "other.jpg"]
    assert log.files() == ["broken.jpg", "other.jpg"] and log.count(1) == 2 and log.count(2) == 4


def test_check_data_decodes_the_whole_image(tmp_path):
    """A JPEG whose headers are whole but whose pixel data is cut opens fine; the scan decodes it."""
    (tmp_path / "a").mkdir()
    rng = np.random.default_rng(0)
    for name in ("whole", "cut"):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(tmp_path / "a" / f"{name}.jpg")
    cut = tmp_path / "a" / "cut.jpg"
    cut.write_bytes(cut.read_bytes()[:-2000])
    source = ImageFolderSource(str(tmp_path), training=True)
    source.load(source.paths.index(str(cut)))  # opening reads the headers only
    found = scan_unreadable(source)
    assert [name for name, _ in found] == [str(cut)] and "truncated" in found[0][1]


def test_sampler_skip_yields_the_rest_of_the_epoch():
    full = EpochSampler(20, training=True, shuffle=True, num_shards=2, shard_id=1, seed=3, start_epoch=4)
    rest = EpochSampler(20, training=True, shuffle=True, num_shards=2, shard_id=1, seed=3, start_epoch=4, skip=6)
    assert len(rest) == 4 and list(rest) == list(full)[6:]


@pytest.fixture()
def small_folder(folder_dir, tmp_path) -> Path:
    """4 training images per class of the sample folders (5 steps of 8), no val split needed."""
    data = tmp_path / "data"
    for class_dir in sorted((folder_dir / "train").iterdir()):
        (data / "train" / class_dir.name).mkdir(parents=True)
        for image in sorted(class_dir.glob("*.jpg"))[:4]:
            shutil.copy(image, data / "train" / class_dir.name / image.name)
    return data


def test_broken_jpeg_is_skipped_counted_and_bounded(small_folder, tmp_path):
    images = sorted((small_folder / "train").glob("*/*.jpg"))
    first, second = images[5], images[30]
    break_image(first)
    args = ["--dataset", "imagenet2012", "--class_num", "10", "--train_image_size", "32", "--batch_size", "8",
            "--num_parallel_workers", "1", "--save_checkpoint", "False", "--max_bad_samples", "1"]
    done = run(train_args(BASE, small_folder, tmp_path / "a", *args, "--check_data", "True"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"unreadable: {first}" in done.stderr  # --check_data lists it up front
    assert "check_data: 1 of 40 training images unreadable (max_bad_samples 1)" in done.stdout
    assert done.stderr.count(f"warning: skipped unreadable image {first}") == 1
    assert "epoch 1 done:" in done.stdout and "; 1 unreadable sample(s) replaced" in done.stdout
    rows = read_metrics(tmp_path / "a" / FOLDER_RUN)
    assert [r["bad_samples"] for r in rows if r["bad_samples"]] == ["1"]

    break_image(second)
    checked = run(train_args(BASE, small_folder, tmp_path / "b", *args, "--check_data", "True"))
    assert checked.returncode == 2 and f"unreadable: {first}" in checked.stderr
    assert f"unreadable: {second}" in checked.stderr
    assert "2 unreadable images, more than max_bad_samples 1" in one_line_error(checked, alone=False)
    assert not (tmp_path / "b").exists()  # refused before anything is written
    stopped = run(train_args(BASE, small_folder, tmp_path / "c", *args))
    assert stopped.returncode == 2
    line = one_line_error(stopped, alone=False)
    assert "more than max_bad_samples 1" in line and str(first) in line and str(second) in line
