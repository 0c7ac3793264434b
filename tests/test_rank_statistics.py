"""Data-parallel runs evaluate and save one network: the ranks' BatchNorm moving statistics (and
their EMA) are made equal before every evaluation and checkpoint (src/training/rank_statistics.py),
so the in-training evaluation of best.ckpt is eval.py's, and a run resumed from a mid-epoch
checkpoint ends with the uninterrupted run's weights and statistics on every rank."""
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from conftest import NO_CURVES, PYTHON, REPO, read_metrics, run
from netns import free_port
from src.resnet import create_model
from src.training.callbacks import SaveSchedule
from src.training.checkpoint import EMA_PREFIX, read_checkpoint
from src.training.faults import KILL_AFTER_STEP
from src.training.rank_statistics import moving_statistics, quantizer_ranges, rank_statistics

CONFIG = str(REPO / "config" / "sample_resnet18.yaml")
NET = "resnet10"  # the smallest of the family: what is checked here does not depend on depth
RUN = Path(NET) / "cifar10"
# BatchNorm trains (not frozen), so each rank's statistics move with its own batches; 2 ranks x 8:
# 12 steps per epoch, a checkpoint every 5 steps (2_5 is global step 17, mid-epoch 2), evaluation
# after each epoch, and the EMA (of the statistics too) evaluated beside the raw weights.
TRAIN = ["--config_path", CONFIG, "--net_name", NET, "--batch_size", "8", "--epoch_size", "2", "--log_interval", "4",
         "--lr_max", "0.05", "--warmup_epochs", "0", "--save_checkpoint_steps", "5", "--run_eval", "True",
         "--model_ema", "True", "--model_ema_decay", "0.99", "--model_ema_steps", "1", "--tensorboard", "False",
         *NO_CURVES]


def launch(cifar_dir: Path, out: Path, *extra: str, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """TRAIN on 2 CPU ranks through the launcher."""
    return run(["bash", str(REPO / "scripts" / "run_distribute_train.sh"), str(cifar_dir), CONFIG, "--workers",
                "2", "--device_target", "CPU", "--master_port", str(free_port()), "--output_dir", str(out),
                *TRAIN[2:], *extra], env=env)


def two_ranks(cifar_dir: Path, out: Path, *extra: str) -> Path:
    """TRAIN on 2 CPU ranks through the launcher; the run folder."""
    launched = launch(cifar_dir, out, *extra)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-2000:]
    return out / RUN


def final_states(folder: Path) -> list:
    return [json.loads((folder / f"final_state_rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cifar_dir) -> Path:
    return two_ranks(cifar_dir, tmp_path_factory.mktemp("straight"))


def evaluate(cifar_dir: Path, checkpoint: Path, *extra: str) -> dict:
    result = run([PYTHON, "eval.py", "--config_path", CONFIG, "--net_name", NET, "--data_path", str(cifar_dir),
                  "--checkpoint_file_path", str(checkpoint), *extra])
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])  # before the report


@pytest.mark.slow
def test_the_in_training_evaluation_of_best_ckpt_is_eval_py_s(straight, cifar_dir, tmp_path):
    """Before, every rank scored its shard with its own statistics (resnet10, 2 ranks, 3 epochs on
    1,000 sample images: top-1 0.9000 in training, 0.8900 for best.ckpt, rank 0's). Now the ranks end
    equal, and the figures recorded for the best epoch are eval.py's on best.ckpt, for the raw weights
    (top-1 and loss) and their EMA (top-1), and so is the run's report of best.ckpt."""
    states = final_states(straight)
    assert states[0]["trainable_sha256"] == states[1]["trainable_sha256"]
    assert states[0]["statistics_sha256"] == states[1]["statistics_sha256"]  # statistics and their EMA
    best = read_checkpoint(str(straight / "best.ckpt"))
    epoch = int(best["epoch_num"].asnumpy())
    evaluations = [r for r in read_metrics(straight) if r["top_1"]]
    assert [int(r["epoch"]) for r in evaluations] == [1, 2] and all(r["ema_top_5"] for r in evaluations)
    # best.ckpt follows the EMA: the epoch of its best top-1 (the earlier one on a tie), its 62 tensors beside the raw
    assert epoch == int(max(evaluations, key=lambda r: (float(r["ema_top_1"]), -int(r["epoch"])))["epoch"])
    assert len([name for name in best if name.startswith(EMA_PREFIX)]) == 62  # resnet10: 38 trainable + 24 statistics
    (row,) = [r for r in evaluations if int(r["epoch"]) == epoch]
    assert float(row["ema_top_1"]) == pytest.approx(float(best["top_1_accuracy"].asnumpy()), abs=1e-6)
    raw = evaluate(cifar_dir, straight / "best.ckpt")
    ema = evaluate(cifar_dir, straight / "best.ckpt", "--use_ema", "True", "--report_dir", str(tmp_path / "report"))
    print(f"best epoch {epoch}: in training top-1 {row['top_1']} loss {row['loss']} EMA top-1 {row['ema_top_1']}; "
          f"eval.py top-1 {raw['top_1_accuracy']:.6f} loss {raw['loss']:.6f} EMA top-1 {ema['top_1_accuracy']:.6f}")
    assert raw["samples"] == 101
    assert float(row["top_1"]) == pytest.approx(raw["top_1_accuracy"], abs=1e-6)
    assert float(row["loss"]) == pytest.approx(raw["loss"], rel=1e-5)
    assert float(row["ema_top_1"]) == pytest.approx(ema["top_1_accuracy"], abs=1e-6)
    # the training's report of best.ckpt (its EMA, which best.ckpt follows) is eval.py's report
    for name in ("per_class.csv", "confusion.csv"):
        assert (straight / "report" / name).read_text() == (tmp_path / "report" / name).read_text(), name


def run_files(folder: Path) -> dict:
    """The run folder's files but the launcher's logs: relative path -> (mtime in ns, size)."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.relative_to(folder).parts[0] != "logs"}


def newest_log(folder: Path, rank: int) -> str:
    return (sorted((folder / "logs").iterdir())[-1] / f"worker_{rank}.log").read_text()


@pytest.mark.slow
def test_resumed_mid_epoch_killed_after_its_last_checkpoint_and_relaunched_ends_as_the_uninterrupted_run(
        straight, cifar_dir, tmp_path):
    """One command with --resume True, launched three times into a folder holding the uninterrupted
    run's mid-epoch checkpoint at global step 17 (written right after the statistics were made
    equal, as the uninterrupted run made them). The first resumes from it, and every rank is killed
    right after the last checkpoint; the second does the run's end on every rank (its report's
    evaluation is collective), which rank 0 alone writes, and exits 0; the third finds the run
    finished and changes nothing. Every rank ends bit for bit as the uninterrupted run, statistics
    included (before, rank 1 took rank 0's statistics from the checkpoint)."""
    folder = tmp_path / RUN
    folder.mkdir(parents=True)
    shutil.copy(straight / f"{NET}-2_5.ckpt", folder)
    # MS_NODE_TIMEOUT: msrun's scheduler waits this long (30 s by default) for the killed ranks
    killed = launch(cifar_dir, tmp_path, "--resume", "True", env=dict(os.environ, MS_NODE_TIMEOUT="8",
                                                                      **{KILL_AFTER_STEP: "24"}))
    assert killed.returncode != 0 and "was killed by signal 9" in killed.stderr.strip().splitlines()[-1]
    assert f"resumed from {folder / f'{NET}-2_5.ckpt'} at global step 17" in killed.stdout
    assert (folder / f"{NET}-2_12.ckpt").exists() and not (folder / "finished.json").exists()

    assert two_ranks(cifar_dir, tmp_path, "--resume", "True") == folder
    logs = [newest_log(folder, rank) for rank in (0, 1)]
    end = f"resume: {folder / f'{NET}-2_12.ckpt'} is the run's last checkpoint (epoch 2 of 2): the run was complete"
    assert f"{end}; finished its end (the final state, the report of the best checkpoint), no training step" in logs[0]
    assert (f"[rank 1] {end}; finished its end (the final state, its share of the report's evaluation), no "
            f"training step") in logs[1]
    assert not re.search(r"^(\[rank 1\] )?epoch \d+ step", logs[0] + logs[1], re.MULTILINE)  # no training step
    assert "report of" in logs[0] and "report of" not in logs[1]  # rank 0 writes the run folder
    assert set(run_files(folder)) == {
        "best.ckpt", "config.yaml", "final_state_rank0.json", "final_state_rank1.json", "finished.json", "metrics.csv",
        f"{NET}-2_5.ckpt", f"{NET}-2_10.ckpt", f"{NET}-2_12.ckpt", "report/confusion.csv", "report/per_class.csv"}
    expected = read_checkpoint(str(straight / f"{NET}-2_12.ckpt"))
    got = read_checkpoint(str(folder / f"{NET}-2_12.ckpt"))
    assert expected.keys() == got.keys()
    differ = [name for name in expected if not np.array_equal(expected[name].asnumpy(), got[name].asnumpy())]
    assert differ == []
    assert final_states(folder) == final_states(straight)  # rank 1 too: its statistics are not in a checkpoint

    before = run_files(folder)
    assert two_ranks(cifar_dir, tmp_path, "--resume", "True") == folder
    finished = f"the run in {folder} is finished ({folder / f'{NET}-2_12.ckpt'} is its last checkpoint, epoch 2 of 2"
    assert all(finished in newest_log(folder, rank) for rank in (0, 1))
    assert run_files(folder) == before  # only the launcher's own log folder is new


def test_one_process_and_frozen_batch_norm_have_nothing_to_make_equal():
    schedule = SaveSchedule(steps_per_epoch=12, epoch_size=2, save_epochs=1)
    net = create_model(NET, num_classes=10)
    assert len(moving_statistics(net)) == 24 and quantizer_ranges(net) == []
    assert rank_statistics(net, ema_params=None, rank=0, group_size=1, schedule=schedule) is None  # untouched
    assert len(rank_statistics(net, ema_params=None, rank=0, group_size=2, schedule=schedule).averaged) == 24
    frozen = create_model(NET, num_classes=10, freeze_bn=True)
    assert rank_statistics(frozen, ema_params=None, rank=0, group_size=2, schedule=schedule) is None


def mid_epoch_saves(schedule: SaveSchedule, steps: range) -> list:
    """The mid-epoch steps `schedule` saves at over `steps`, as the saver and RankStatistics walk them."""
    due = []
    for step in steps:
        if schedule.due_in_epoch(step):
            due.append(step)
            schedule.saved(step)
        if step % schedule.steps_per_epoch == 0 and schedule.due_at_epoch_end(step // schedule.steps_per_epoch):
            schedule.saved(step)
    return due


def test_the_statistics_follow_the_checkpoint_schedule():
    """Every rank makes them equal where the writer saves: every 5 steps counted from the last save,
    an epoch's end not among them (it is saved, and made equal, as the epoch's end); a run resumed
    from a save goes on as the uninterrupted one."""
    def schedule(**kwargs) -> SaveSchedule:
        return SaveSchedule(steps_per_epoch=12, epoch_size=2, save_epochs=1, save_steps=5, **kwargs)

    assert mid_epoch_saves(schedule(), range(1, 25)) == [5, 10, 17, 22]
    assert mid_epoch_saves(schedule(first_step=17), range(18, 25)) == [22]
    assert mid_epoch_saves(schedule(periodic=False), range(1, 25)) == []
