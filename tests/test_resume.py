"""Exact resume: after SIGTERM mid-epoch, after SIGKILLs at random moments of a relaunched job
(with its TensorBoard record); fine-tuning, bad checkpoints and the run record. Checkpoint files
themselves (atomic saves, best.ckpt, rotation) are in tests/test_checkpoint_files.py."""
import hashlib
import os
import signal
import subprocess
import time
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from PIL import Image

from conftest import (
    NO_CURVES,
    PYTHON,
    REPO,
    Started,
    one_line_error,
    read_metrics,
    run,
    start,
    train_args,
    wait_for_step,
)
from src.config import read_yaml
from src.training.board import event_files
from src.training.checkpoint import EMA_PREFIX, list_checkpoints, network_part, read_checkpoint
from src.training.faults import KILL_AFTER_STEP
from tensorboard_api import BOARD_RUN, assert_scalars_equal_record, tensorboard

pytestmark = pytest.mark.slow  # trains, exports or starts processes: not in the quick tier

CONFIG = str(REPO / "config" / "sample_resnet18.yaml")
NET = "resnet10"  # the smallest of the family: what is checked here does not depend on depth
RUN = Path(NET) / "cifar10"
# 12 steps per epoch (200 images, batch 16); every step logged so per-step losses can be compared.
TRAIN = ["--config_path", CONFIG, "--net_name", NET, "--batch_size", "16", "--log_interval", "1", "--run_eval", "False",
         "--lr_max", "0.05", "--warmup_epochs", "0", *NO_CURVES]


# The optimization recipe on (tests/test_train_step.py checks each part against a reference): 2
# micro-batches of 8 per step (still 12 steps per epoch), EMA, clipping and a dynamic loss scale, so
# resume must restore the EMA weights, the step counter and the loss-scale state exactly. And the
# data recipe (tests/test_data_recipe.py): a policy, erasing, mixup/cutmix and repeated augmentation,
# whose draws are keyed like the crops, so a resumed run must see the very same batches.
RECIPE = ["--batch_size", "8", "--grad_accumulation_steps", "2", "--model_ema", "True", "--model_ema_decay", "0.99",
          "--model_ema_steps", "5", "--clip_grad_norm", "1.0", "--loss_scale_type", "dynamic", "--loss_scale", "1024",
          "--auto_augment", "cifar10", "--random_erase", "0.25", "--mixup_alpha", "0.2", "--cutmix_alpha", "1.0",
          "--ra_reps", "2", "--use_label_smooth", "True"]


# The uninterrupted run, and every launch compared with it: evaluation, its report and the curves
# on, so a run's end (src/training/loop.py, end_run) has all its parts.
STRAIGHT = ["--epoch_size", "3", *RECIPE, "--run_eval", "True", "--plot_curves", "True"]
LAST_STEP = 36


def step_losses(folder: Path) -> dict:
    return {int(r["step"]): float(r["loss"]) for r in read_metrics(folder) if r["loss"] and not r["top_1"]}


def weights(path: Path) -> dict:
    return {k: v.asnumpy() for k, v in read_checkpoint(str(path)).items()
            if not k.startswith(("learning_rate",))}


def kill_when(process: Started, path: Path, delay: float = 0.0, timeout: float = 300) -> None:
    """SIGKILL `process` `delay` seconds after `path` appears."""
    deadline = time.time() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()[1][-2000:]
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    time.sleep(delay)
    process.send_signal(signal.SIGKILL)
    process.wait()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cifar_dir) -> Path:
    out = tmp_path_factory.mktemp("straight")
    result = run(train_args(TRAIN, cifar_dir, out, *STRAIGHT))
    assert result.returncode == 0, result.stderr[-3000:]
    return out / RUN


def test_eval_and_export_use_the_ema_weights_or_say_there_are_none(uninterrupted, cifar_dir, tmp_path):
    from src.resnet import create_model
    from src.training.checkpoint import load_into_network
    path = uninterrupted / f"{NET}-3_12.ckpt"
    stored = weights(path)
    net = create_model(NET, num_classes=10)
    load_into_network(net, str(path), use_ema=True)
    for param in net.get_parameters():
        np.testing.assert_array_equal(param.asnumpy(), stored[EMA_PREFIX + param.name])
    plain = tmp_path / "plain.ckpt"
    ms.save_checkpoint(create_model(NET, num_classes=10), str(plain))
    for script in ("eval.py", "export.py"):
        result = run([PYTHON, script, "--config_path", CONFIG, "--net_name", NET, "--data_path", str(cifar_dir),
                      "--checkpoint_file_path",
                      str(plain), "--use_ema", "True", "--file_name", str(tmp_path / "exported")])
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and "EMA" in lines[0] and "use_ema" in lines[0], result.stderr
    assert not list(tmp_path.glob("exported*"))


@pytest.fixture(scope="module")
def relaunched(tmp_path_factory, cifar_dir) -> tuple:
    """The uninterrupted run's command, stopped twice: by SIGTERM in epoch 2, then, relaunched with
    --resume True, killed right after its last checkpoint (KILL_AFTER_STEP), and relaunched again,
    which has only the run's end left. The run folder and the outputs of the three launches."""
    out = tmp_path_factory.mktemp("relaunched")
    folder = out / RUN
    command = train_args(TRAIN, cifar_dir, out, *STRAIGHT)
    process = start(command)
    wait_for_step(folder, 16, process)
    process.send_signal(signal.SIGTERM)
    stopped = subprocess.CompletedProcess(command, None, *process.communicate(timeout=120))
    stopped.returncode = process.returncode
    relaunch = command + ["--resume", "True"]
    killed = run(relaunch, env=dict(os.environ, **{KILL_AFTER_STEP: str(LAST_STEP)}))
    return folder, stopped, killed, run(relaunch)


def test_sigterm_mid_epoch_then_resume_equals_uninterrupted_run(relaunched, uninterrupted):
    folder, stopped, resumed, _ = relaunched
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    (saved,) = set(folder.glob(f"{NET}-2_*.ckpt")) - {folder / f"{NET}-2_12.ckpt"}  # mid-epoch 2
    step = 12 + int(saved.stem.split("_")[1])
    assert 16 <= step < 24
    assert f"stopped by SIGTERM after global step {step} (mid-epoch); saved {saved}" in stopped.stdout
    assert "--resume True" in stopped.stdout.strip().splitlines()[-1]

    assert resumed.returncode == -signal.SIGKILL, resumed.stderr[-3000:]  # killed after its last checkpoint
    assert f"resumed from {saved} at global step {step}" in resumed.stdout
    expected, got = step_losses(uninterrupted), step_losses(folder)
    assert sorted(got) == list(range(1, 37))
    assert max(abs(expected[s] - got[s]) for s in expected) < 1e-5
    final_expected = weights(uninterrupted / f"{NET}-3_12.ckpt")
    final_got = weights(folder / f"{NET}-3_12.ckpt")
    assert max(float(np.abs(final_expected[k] - final_got[k]).max()) for k in final_expected) < 1e-5


# What differs between two runs of one command besides the run folder: the clock.
TIMING = ("img_per_s", "wall_time", "data_wait")


def files(folder: Path) -> dict:
    """Every file and folder under `folder` (relative path -> its modification time in ns and the
    sha256 of its bytes, False for a folder)."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.is_file() and digest_of(p))
            for p in sorted(folder.rglob("*"))}


def digest_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def untimed_record(folder: Path) -> list:
    return [{k: v for k, v in row.items() if k not in TIMING} for row in read_metrics(folder)]


def board_events(folder: Path) -> list:
    """The run's TensorBoard record as sorted (step, tag, value): a scalar's value, or what another
    summary holds (the report's pictures show the run folder's path, which differs); no timing."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboardX.proto.event_pb2 import Event
    found = []
    for path in event_files(str(folder / "tensorboard")):
        for record in RawEventFileLoader(path).Load():
            event = Event.FromString(record)
            found += [(event.step, value.tag, value.simple_value if value.HasField("simple_value")
                       else value.WhichOneof("value")) for value in event.summary.value
                      if not value.tag.endswith(TIMING)]
    return sorted(found, key=str)


def test_a_relaunch_after_the_last_checkpoint_does_the_end_of_the_uninterrupted_run(relaunched, uninterrupted):
    """No training step, one line, exit 0: the final state, the curves, the report of best.ckpt and
    the end of the TensorBoard session, as the uninterrupted run wrote them (its clock aside)."""
    folder, _, _, finished = relaunched
    assert finished.returncode == 0, finished.stderr[-3000:]
    lines = finished.stdout.strip().splitlines()
    assert not [line for line in lines if line.startswith(("training ", "epoch "))]  # no step, no evaluation
    last = lines[-1]
    assert last == (f"resume: {folder / f'{NET}-3_12.ckpt'} is the run's last checkpoint (epoch 3 of 3): the run "
                    f"was complete; finished its end (the final state, the curves, the report of the best "
                    f"checkpoint, the TensorBoard session), no training step"), last
    ours, theirs = files(folder), files(uninterrupted)
    (stop,) = {name for name in ours if name.startswith(f"{NET}-2_") and name != f"{NET}-2_12.ckpt"}
    assert {n for n in ours if "tensorboard/" not in n} - {stop} == {n for n in theirs if "tensorboard/" not in n}
    same_bytes = [n for n in theirs if n.endswith((".ckpt", ".json", ".csv", "curves.png")) and n != "metrics.csv"]
    assert len(same_bytes) == 9  # 3 epochs, best.ckpt, final state, finished.json, report/*.csv, curves.png
    assert {n: ours[n][1] for n in same_bytes} == {n: theirs[n][1] for n in same_bytes}
    assert untimed_record(folder) == untimed_record(uninterrupted)
    config, straight_config = read_yaml(str(folder / "config.yaml")), read_yaml(str(uninterrupted / "config.yaml"))
    assert {k: v for k, v in config.items() if k not in ("output_dir", "resume")} == \
        {k: v for k, v in straight_config.items() if k not in ("output_dir", "resume")}
    assert board_events(folder) == board_events(uninterrupted)


def test_relaunching_a_finished_run_changes_nothing(relaunched, cifar_dir):
    folder = relaunched[0]
    before = files(folder)
    again = run(train_args(TRAIN, cifar_dir, folder.parents[1], *STRAIGHT, "--resume", "True"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.strip().splitlines()[-1] == (
        f"resume: the run in {folder} is finished ({folder / f'{NET}-3_12.ckpt'} is its last checkpoint, epoch 3 "
        f"of 3, and its end is done); nothing is left to do")
    assert files(folder) == before


def test_a_complete_checkpoint_named_by_resume_ckpt_is_refused(uninterrupted, cifar_dir):
    """--resume_ckpt may name another folder's checkpoint: one that ends the run is refused, as a new
    run into a folder that holds one is (test_a_new_run_into_a_folder_that_holds_one_...)."""
    before = files(uninterrupted)
    final = uninterrupted / f"{NET}-3_12.ckpt"
    named = run(train_args(TRAIN, cifar_dir, uninterrupted.parents[1], *STRAIGHT, "--resume_ckpt", str(final)))
    assert one_line_error(named) == (f"error: checkpoint {final} is at epoch 3 of 3: the run is complete; raise "
                                     f"--epoch_size to train on")
    assert files(uninterrupted) == before


def test_run_record_files_exist_and_parse(uninterrupted):
    rows = read_metrics(uninterrupted)
    assert list(rows[0]) == ["epoch", "step", "loss", "lr", "top_1", "top_5", "img_per_s", "wall_time",
                             "bad_samples", "ema_top_1", "ema_top_5", "data_wait", "loss_scale", "grad_norm", "ece"]
    assert [int(r["step"]) for r in rows if r["top_1"]] == [12, 24, 36]
    rows = [r for r in rows if not r["top_1"]]  # the training steps
    assert len(rows) == 36 and all(float(r["img_per_s"]) > 0 for r in rows)
    assert [float(r["wall_time"]) for r in rows] == sorted(float(r["wall_time"]) for r in rows)
    with Image.open(uninterrupted / "curves.png") as image:
        assert image.format == "PNG" and image.width > 100 and image.height > 100
    assert "epoch_size: 3" in (uninterrupted / "config.yaml").read_text()


@pytest.fixture(scope="module")
def pretrained(uninterrupted) -> Path:
    return uninterrupted / f"{NET}-1_12.ckpt"


def test_fine_tune_with_another_class_count(pretrained, cifar_dir, tmp_path):
    frozen_lr = ["--lr_init", "0", "--lr_max", "0", "--lr_end", "0", "--weight_decay", "0", "--epoch_size", "1"]
    refused = run(train_args(TRAIN, cifar_dir, tmp_path / "a", "--class_num", "12", "--pre_trained", str(pretrained)))
    assert refused.returncode == 2 and "filter_weight" in refused.stderr and "fc.weight" in refused.stderr
    assert not (tmp_path / "a").exists()
    tuned = run(train_args(TRAIN, cifar_dir, tmp_path / "b", "--class_num", "12", "--pre_trained", str(pretrained),
                           "--filter_weight", "True", *frozen_lr))
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert "skipped the head: fc.weight (10, 512), fc.bias (10,)" in tuned.stdout
    before, after = weights(pretrained), weights(tmp_path / "b" / RUN / f"{NET}-1_12.ckpt")
    assert after["fc.weight"].shape == (12, 512)
    np.testing.assert_array_equal(after["conv1.weight"], before["conv1.weight"])  # lr 0: backbone as loaded


def digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.is_file()}


@pytest.mark.parametrize("kind", ["truncated", "corrupt", "empty", "wrong_network"])
@pytest.mark.parametrize("key", ["resume_ckpt", "pre_trained"])
def test_bad_checkpoint_is_one_line_and_changes_nothing(kind, key, uninterrupted, cifar_dir, tmp_path):
    good = uninterrupted / f"{NET}-1_12.ckpt"
    bad = tmp_path / f"{kind}.ckpt"
    data = good.read_bytes()
    bad.write_bytes({"truncated": data[: len(data) // 2], "corrupt": data[:1000] + os.urandom(4000) + data[5000:],
                     "empty": b"", "wrong_network": b""}[kind])
    if kind == "wrong_network":
        from src.resnet import create_model
        ms.save_checkpoint(create_model("resnet34", num_classes=10), str(bad))
    before = digest(uninterrupted)
    result = run(train_args(TRAIN, cifar_dir, uninterrupted.parents[1], f"--{key}", str(bad), "--epoch_size", "3"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0], result.stderr[-2000:]
    assert digest(uninterrupted) == before


def recorded_steps(folder: Path) -> int:
    """The furthest global step in the run record (0 before there is one)."""
    path = folder / "metrics.csv"
    rows = path.read_text().splitlines()[1:] if path.exists() else []
    return max((int(row.split(",")[1]) for row in rows if row.count(",") > 1), default=0)


def test_relaunched_after_random_kills_ends_with_the_uninterrupted_weights(uninterrupted, cifar_dir, tmp_path):
    """The relaunch path of a requeued job: one command line for every launch (--resume True from
    the first), SIGKILLed at moments drawn from a printed seed, relaunched until it finishes; with
    evaluation, so kills also land in evaluations and best.ckpt and report writes."""
    seed = int(os.environ.get("CHAOS_SEED", time.time_ns() % 10_000))
    rng = np.random.default_rng(seed)
    command = train_args(TRAIN, cifar_dir, tmp_path, "--epoch_size", "3", "--save_checkpoint_steps", "5",
                         "--resume", "True", "--run_eval", "True", *RECIPE)
    folder = tmp_path / RUN
    kills = []
    # the moments: once during start-up (seconds after launch), then twice at a random step beyond
    # what is recorded, a random fraction of a step later (a step takes ~0.1 s)
    for launch in range(3):
        process = start(command, merge_stderr=True)
        if launch == 0:
            moment = f"{rng.uniform(0.5, 2.0):.2f} s after launch"  # importing and compiling
            time.sleep(float(moment.split()[0]))
        else:
            step = int(rng.integers(min(recorded_steps(folder) + 1, 35), 36))
            delay = rng.uniform(0.0, 0.15)
            moment = f"{delay:.2f} s after global step {step}"
            wait_for_step(folder, step, process)
            time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        output = process.communicate()[0].strip().splitlines()
        saved = [os.path.basename(path) for _, _, path in list_checkpoints(str(folder), NET)]
        kills.append(f"{moment}: last line {output[-1][:90] if output else '(none)'!r}; "
                     f"checkpoints {saved}; best.ckpt {(folder / 'best.ckpt').exists()}")
    print(f"chaos seed {seed} (CHAOS_SEED={seed} repeats it); the kills:")
    print("\n".join(f"  {kill}" for kill in kills))
    finished = run(command)
    assert finished.returncode == 0, finished.stderr[-3000:]

    expected, got = step_losses(uninterrupted), step_losses(folder)
    assert sorted(got) == list(range(1, 37))  # each step recorded exactly once
    assert max(abs(expected[s] - got[s]) for s in expected) < 1e-5
    final_expected = weights(uninterrupted / f"{NET}-3_12.ckpt")
    final_got = weights(folder / f"{NET}-3_12.ckpt")
    assert final_expected.keys() == final_got.keys()
    ema = [k for k in final_expected if k.startswith(EMA_PREFIX)]
    assert len(ema) == len(network_part(final_expected)) == 62  # 38 trainable + 24 BatchNorm statistics
    worst = {part: max(float(np.abs(final_expected[k] - final_got[k]).max()) for k in keys)
             for part, keys in (("raw", network_part(final_expected)), ("EMA", ema), ("all", final_expected))}
    print(f"final weights vs the uninterrupted run, max abs difference: {worst}")
    assert worst["all"] < 1e-5
    assert float(np.abs(final_expected["ema.fc.weight"] - final_expected["fc.weight"]).max()) > 1e-4  # EMA lags
    assert not (folder / "curves.png").exists()  # --plot_curves False: the record and TensorBoard only
    assert sorted(p.name for p in (folder / "report").iterdir()) == ["confusion.csv", "per_class.csv"]  # no pictures
    evaluations = [row for row in read_metrics(folder) if row["top_1"]]
    assert [int(row["epoch"]) for row in evaluations] == [1, 2, 3]  # each epoch evaluated once
    assert [int(row["step"]) for row in evaluations] == [12, 24, 36]  # at its last step, resumed mid-epoch or not
    best = float(read_checkpoint(str(folder / "best.ckpt"))["top_1_accuracy"].asnumpy())
    assert best == pytest.approx(max(float(row["ema_top_1"] or row["top_1"]) for row in evaluations), abs=1e-6)
    assert (folder / "report").is_dir()
    # TensorBoard, through a real server: one continuous record, each step once, equal to metrics.csv
    with tensorboard(folder) as board:
        board.wait_for_step("eval/top_1", 36)  # the last evaluation (no report pictures: --plot_curves False)
        assert_scalars_equal_record(board, read_metrics(folder))
        assert len(board.session_groups()) == 1
        assert len(board.get(f"data/plugin/images/images?run={BOARD_RUN}&tag=data/first_batch")) == 1


def test_a_new_run_into_a_folder_that_holds_one_is_one_line_and_changes_nothing(cifar_dir, tmp_path):
    folder = tmp_path / RUN
    folder.mkdir(parents=True)
    record = "epoch,step,loss\n1,12,2.0\n"
    (folder / "metrics.csv").write_text(record)
    result = run(train_args(TRAIN, cifar_dir, tmp_path, *NO_CURVES))
    line = one_line_error(result)
    assert "already holds a run; continue it with --resume True" in line and str(folder) in line
    assert sorted(p.name for p in folder.iterdir()) == ["metrics.csv"]
    assert (folder / "metrics.csv").read_text() == record
