"""Watching a run: its TensorBoard record read back through a real TensorBoard server's HTTP API,
the data-wait share and the input-bound line, the profiler's table. (A run killed and relaunched
is read back the same way in tests/test_resume.py, after the relaunch chaos test.)"""
import csv
import io
import shutil
from pathlib import Path
from typing import List

import numpy as np
import pytest
from mindspore import Tensor, nn
from mindspore.train.callback import RunContext
from mindspore.train.callback._callback import InternalCallbackParam
from PIL import Image

from conftest import NO_CURVES, PYTHON, REPO, read_metrics, run, train_args
from src.cpu_layers import unavailable_reason
from src.data.sources import CIFAR_RECORD_BYTES
from src.evaluation.profile_table import find_summary, read_summary
from src.training.callbacks import PLOT_EVERY_SECONDS, ProfilerMonitor, RecordPlotter
from src.training.run_record import RunRecord
from src.training.step_time import INPUT_BOUND_SHARE
from tensorboard_api import BOARD_RUN, assert_scalars_equal_record, tensorboard

pytestmark = pytest.mark.slow  # trains and starts servers: not in the quick tier

CONFIG = str(REPO / "config" / "sample_resnet18.yaml")
NET = "resnet10"  # the smallest of the family: what is watched does not depend on depth
RUN = Path(NET) / "cifar10"
# 12 steps per epoch (200 images, batch 16); clipping, so the step reports its gradient norm.
TRAIN = ["--config_path", CONFIG, "--net_name", NET, "--batch_size", "16", "--lr_max", "0.05", "--warmup_epochs", "0",
         "--clip_grad_norm", "1.0", *NO_CURVES]


def test_tensorboard_serves_the_runs_scalars_config_and_pictures(sample_run):
    folder, _ = sample_run
    rows = read_metrics(folder)
    with tensorboard(folder) as board:
        board.wait_for("images", "report/calibration")
        tags = board.get("data/plugin/scalars/tags")[BOARD_RUN]
        assert {"train/loss", "train/lr", "train/img_per_s", "train/data_wait", "train/loss_scale", "train/grad_norm",
                "eval/top_1", "eval/top_5", "eval/loss", "eval/ece"} <= set(tags)
        assert_scalars_equal_record(board, rows)

        groups = board.session_groups()
        assert len(groups) == 1 and groups[0]["hparams"]["net_name"] == "resnet10"
        assert groups[0]["hparams"]["epoch_size"] == 2 and groups[0]["hparams"]["batch_size"] == 16
        last = {m["name"]["tag"]: m["value"] for m in groups[0]["metricValues"]}
        assert np.isclose(last["eval/top_1"], float(rows[-1]["top_1"]))
        assert groups[0]["sessions"][0]["status"] == "STATUS_SUCCESS"

        images = board.get("data/plugin/images/tags")[BOARD_RUN]
        assert {"data/first_batch", "report/confusion", "report/calibration"} <= set(images)
        first = board.get(f"data/plugin/images/images?run={BOARD_RUN}&tag=data/first_batch")
        assert [entry["step"] for entry in first] == [0]
        with Image.open(io.BytesIO(board.get(f"data/plugin/images/individualImage?{first[0]['query']}"))) as picture:
            assert picture.width > 200 and picture.height > 200
        texts = board.get("data/plugin/text/tags")[BOARD_RUN]
        assert any(tag.startswith("profiler/top_operators") for tag in texts)


def test_curves_are_redrawn_at_most_once_a_minute(tmp_path):
    now = [0.0]
    record = RunRecord(str(tmp_path))
    plotter = RecordPlotter(record, clock=lambda: now[0])
    curves = tmp_path / "curves.png"

    def epoch_ends_at(seconds: float) -> bool:
        now[0] = seconds
        record.add(epoch=1, step=int(seconds), loss=1.0, lr=0.1)
        curves.unlink(missing_ok=True)
        plotter.on_train_epoch_end(None)
        return curves.exists()

    assert [epoch_ends_at(t) for t in (10, PLOT_EVERY_SECONDS - 1, PLOT_EVERY_SECONDS, PLOT_EVERY_SECONDS + 5,
                                      2 * PLOT_EVERY_SECONDS)] == [False, False, True, False, True]
    with Image.open(curves) as image:  # the run's end draws them last (test_resume.py checks curves.png)
        assert image.format == "PNG" and image.width > 100


def test_a_normal_run_waits_little_for_data(sample_run):
    folder, stdout = sample_run
    waits = [float(r["data_wait"]) for r in read_metrics(folder) if r["data_wait"]]
    assert len(waits) == 6 and all(0 <= wait < INPUT_BOUND_SHARE for wait in waits)
    assert "input-bound" not in stdout


def test_profiler_table_names_the_convolutions(sample_run):
    folder, _ = sample_run
    with open(folder / "profiler" / "rank0" / "top_operators.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == 10
    shares = [float(row["share"]) for row in table]
    assert 0 < sum(shares) <= 1 + 1e-9 and shares == sorted(shares, reverse=True)
    kinds = {row["op_type"] for row in table}
    # cpu_convolution auto: this repository's layers, named by the cell that runs them (src/cpu_layers)
    expected = ({"Conv2D", "Conv2DBackpropFilter", "Conv2DBackpropInput"} if unavailable_reason()
                else {"Custom:OneDnnConv2d", "Custom:OneDnnConv2d backward"})
    assert expected <= kinds, kinds
    assert all(float(row["calls_per_step"]) > 0 and float(row["ms_per_step"]) > 0 for row in table)


def test_the_profiler_counts_steps_not_callbacks_and_a_report_failure_is_a_warning(tmp_path):
    """In sink mode a callback ends a whole sink: 4 sinks of 4 steps, one skipped, one warm-up, 2
    profiled are 8 profiled steps, and the table's figures are per step. A table that cannot be
    written is one warning line; nothing is raised into the training."""
    folder = tmp_path / "profiler"
    (folder / "top_operators.csv").mkdir(parents=True)  # where the table goes: writing it fails
    lines: List[str] = []
    monitor = ProfilerMonitor(folder=str(folder), device_target="CPU", steps=2, log=lines.append)
    net = nn.Dense(64, 64)

    def context(step):
        return RunContext(InternalCallbackParam(cur_step_num=step, cur_epoch_num=1))

    monitor.on_train_begin(context(0))
    for sink_end in (4, 8, 12, 16):
        for _ in range(4):  # one sink's steps
            net(Tensor(np.ones((8, 64), np.float32))).asnumpy()
        monitor.on_train_step_end(context(sink_end))
    assert monitor.profiled_steps == 8 and monitor.profiler is None
    summary = find_summary(str(folder))
    matmul = next(row for row in read_summary(summary, monitor.profiled_steps) if row.op_type == "MatMul")
    assert matmul.calls_per_step == 1.0  # 8 calls over 8 steps, not 8 over 2 callbacks
    assert [line for line in lines if line.startswith("warning: the profiler's report was not written")]


# The training data source, slowed by a test-only delay per sample, then train.py as usual.
SLOWED = """
import runpy, sys, time
import src.data.sources
load = src.data.sources.CifarBinarySource.load
src.data.sources.CifarBinarySource.load = lambda self, index: (time.sleep({delay}), load(self, index))[1]
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
"""


def test_slowed_input_is_reported_input_bound(cifar_dir, tmp_path):
    # 64 training images, 62.5 ms each in the source: 1 s to make a batch of 16, several times what
    # a resnet10 step takes even on a machine busy with other tests, for 4 steps an epoch.
    data = tmp_path / "data"
    data.mkdir()
    records = b"".join(path.read_bytes() for path in sorted(cifar_dir.glob("data_batch_*.bin")))
    (data / "data_batch_1.bin").write_bytes(records[:64 * CIFAR_RECORD_BYTES])
    shutil.copy(cifar_dir / "test_batch.bin", data / "test_batch.bin")
    args = train_args(TRAIN, data, tmp_path, "--epoch_size", "2", "--log_interval", "4", "--run_eval", "False",
                      "--tensorboard", "False")
    result = run([PYTHON, "-c", SLOWED.format(delay=0.0625)] + args[2:])
    assert result.returncode == 0, result.stderr[-3000:]
    # epoch 1 also holds the graph's compilation (running, not waiting), so epoch 2 is the one to judge
    second_epoch = [float(r["data_wait"]) for r in read_metrics(tmp_path / RUN) if r["epoch"] == "2"]
    assert len(second_epoch) == 1 and second_epoch[0] > INPUT_BOUND_SHARE, second_epoch
    bound = {line.split()[2]: line for line in result.stdout.splitlines() if line.startswith("input-bound: ")}
    assert "2" in bound and "raise num_parallel_workers (now 1;" in bound["2"]
    assert not (tmp_path / RUN / "tensorboard").exists()


def test_pruning_keeps_the_steps_a_checkpoint_covers_and_cuts_a_half_written_event(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from src.training.board import Board, event_files, prune_events
    board = Board(str(tmp_path))
    for step in range(1, 9):
        board.scalars(step, {"train/loss": 1.0 / step})
        if step == 5:  # written after the checkpoint at step 5: a relaunch from it writes them again
            board.text("profiler/top_operators", "| operator |", step)
            board.image("report/confusion", np.zeros((4, 4, 3), np.uint8), step)
            board.finished(step)
    board.close()
    (path,) = event_files(str(tmp_path / "tensorboard"))
    with open(path, "ab") as handle:  # a kill in the middle of writing an event
        handle.write(b"\x40\x00\x00\x00\x00\x00\x00\x00partial")

    def steps() -> list:
        return [(event.step, value.tag) for event in EventFileLoader(path).Load() for value in event.summary.value]

    assert prune_events(str(tmp_path / "tensorboard"), keep_through=5) == 6
    assert steps() == [(step, "train/loss") for step in range(1, 6)]
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "tensorboard").iterdir())
    size = Path(path).stat().st_size
    assert prune_events(str(tmp_path / "tensorboard"), keep_through=5) == 0 and Path(path).stat().st_size == size
    Board(str(tmp_path)).close()  # a run starting over in the folder: nothing of the old record stays
    assert all(not [e for e in EventFileLoader(p).Load() if e.summary.value]
               for p in event_files(str(tmp_path / "tensorboard")))
