"""Shared fixtures: the repository on sys.path, fast CPU convolutions, small generated datasets."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
sys.path.insert(0, str(REPO))
os.environ.setdefault("GLOG_v", "3")

from src.data.sample_data import write_sample_data  # noqa: E402
from src.device import prefer_fast_cpu_convolutions  # noqa: E402

prefer_fast_cpu_convolutions()


@pytest.fixture(scope="session")
def sample_root(tmp_path_factory) -> Path:
    """Sample data in both formats: 20 training images per class, a test split of 101 (odd) images."""
    root = tmp_path_factory.mktemp("sample")
    write_sample_data(str(root), train_per_class=20, test_total=101, seed=0)
    return root


@pytest.fixture(scope="session")
def cifar_dir(sample_root) -> Path:
    return sample_root / "cifar10"


@pytest.fixture(scope="session")
def folder_dir(sample_root) -> Path:
    return sample_root / "imagenet"


@pytest.fixture(scope="session")
def tiny_folder_dir(folder_dir, tmp_path_factory) -> Path:
    """folder_dir cut to 4 training and 2 validation images per class: one step at the model zoo's
    batch 32, for networks too slow on 2 cores to train the whole split in a test."""
    root = tmp_path_factory.mktemp("tiny_imagenet")
    for split, keep in (("train", 4), ("val", 2)):
        for folder in sorted(p for p in (folder_dir / split).iterdir() if p.is_dir()):
            (root / split / folder.name).mkdir(parents=True)
            for image in sorted(folder.iterdir())[:keep]:
                shutil.copy(image, root / split / folder.name / image.name)
    return root


def run(args: List[str], cwd: Optional[Path] = None, timeout: int = 600,
        env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """Run a command of the project (python scripts or bash launchers) and capture its output.

    `env` replaces the inherited environment when given."""
    full_env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    return subprocess.run(args, cwd=str(cwd or REPO), capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def wait_for_step(folder: Path, step: int, process: subprocess.Popen, timeout: float = 300) -> None:
    """Wait until the run record (metrics.csv) in `folder` holds global step `step`, while
    `process` trains (a stop signal sent then lands mid-run, not during start-up)."""
    deadline = time.time() + timeout
    while True:
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.time() < deadline, f"step {step} never came"
        path = folder / "metrics.csv"
        if path.exists() and any(line.split(",")[1:2] == [str(step)] for line in path.read_text().splitlines()):
            return
        time.sleep(0.05)
