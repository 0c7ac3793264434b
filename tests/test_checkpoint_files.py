"""Checkpoint files: saves that a kill cannot leave half-written, rotation, and the relaunch check
of a folder without checkpoints (best.ckpt following the EMA: tests/test_rank_statistics.py). (A
module of its own so the suite's workers share the resume tests' time.)"""
import os

import mindspore as ms
import pytest

from conftest import start, train_args
from src.errors import UserInputError
from src.training.checkpoint import read_checkpoint, rotate
from test_resume import CONFIG, NET, RUN, TRAIN, kill_when

pytestmark = pytest.mark.slow  # trains, exports or starts processes: not in the quick tier


def test_kill_during_saves_leaves_only_loadable_checkpoints(cifar_dir, tmp_path):
    # A checkpoint every step: most of the time is spent saving, so the kills land mid-save.
    for attempt, delay in enumerate((0.05, 0.2, 0.45)):
        out = tmp_path / str(attempt)
        process = start(train_args(TRAIN, cifar_dir, out, "--epoch_size", "3", "--save_checkpoint_steps", "1",
                                   "--keep_checkpoint_max", "3"))
        kill_when(process, out / RUN / f"{NET}-1_2.ckpt", delay)
        finals = sorted((out / RUN).glob(f"{NET}-*.ckpt"))
        assert finals
        for path in finals:
            read_checkpoint(str(path))  # raises on a truncated or corrupt file


def test_rotation_keeps_the_newest_and_the_newest_epoch_end(tmp_path):
    names = ["resnet18-1_12.ckpt", "resnet18-2_4.ckpt", "resnet18-2_8.ckpt", "resnet18-2_12.ckpt",
             "resnet18-3_4.ckpt", "resnet18-3_8.ckpt", "resnet18-3_10.ckpt"]
    for age, name in enumerate(names):
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (1000 + age, 1000 + age))
    (tmp_path / "best.ckpt").write_bytes(b"x")
    removed = rotate(str(tmp_path), "resnet18", keep=2, steps_per_epoch=12)
    left = sorted(p.name for p in tmp_path.iterdir())
    # two checkpoints: the newest end-of-epoch one (what --resume needs) and the newest; best.ckpt apart
    assert left == ["best.ckpt", "resnet18-2_12.ckpt", "resnet18-3_10.ckpt"]
    assert len(removed) == 5



def test_resume_refuses_a_folder_of_another_run_without_checkpoints(tmp_path):
    from src.config import load_config, save_config
    from src.errors import UserInputError
    from src.training.resume import check_relaunch_folder
    config = load_config(["--config_path", CONFIG])
    check_relaunch_folder(config, str(tmp_path))  # empty: fine
    save_config(config, str(tmp_path / "config.yaml"))
    relaunched = load_config(["--config_path", CONFIG, "--resume", "True"])
    check_relaunch_folder(relaunched, str(tmp_path))  # the same run relaunched: fine
    other = load_config(["--config_path", CONFIG, "--seed", "7"])
    with pytest.raises(UserInputError, match=r"holds another run \(its config.yaml has seed: 1, this one 7\)"):
        check_relaunch_folder(other, str(tmp_path))


def low_free_memory(monkeypatch) -> None:
    """The OS reports one free page, as it does once the page cache holds nearly all memory."""
    sysconf = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: 1 if name == "SC_AVPHYS_PAGES" else sysconf(name))


def test_a_checkpoint_loads_while_the_page_cache_holds_the_free_memory(tmp_path, monkeypatch):
    """MindSpore's own check counts free memory only; the page cache is memory a load can have."""
    from src.resnet import create_model
    path = tmp_path / "resnet18.ckpt"
    ms.save_checkpoint(create_model("resnet18", num_classes=10), str(path))
    low_free_memory(monkeypatch)
    assert len(read_checkpoint(str(path))) == 102


def test_a_checkpoint_larger_than_the_memory_available_says_so(tmp_path, monkeypatch):
    from src.resnet import create_model
    from src.training import checkpoint
    path = tmp_path / "resnet18.ckpt"
    ms.save_checkpoint(create_model("resnet18", num_classes=10), str(path))
    low_free_memory(monkeypatch)
    monkeypatch.setattr(checkpoint, "available_memory", lambda: 1 << 20)  # 1 MiB left
    with pytest.raises(UserInputError, match=r"resnet18.ckpt \(43 MiB\) does not fit in the memory available now"):
        read_checkpoint(str(path))
