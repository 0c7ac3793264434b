"""A real TensorBoard server over a run folder, asked through its HTTP API (for the tests)."""
import contextlib
import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, Iterator, List

import numpy as np

from conftest import PYTHON
from netns import free_port

BOARD_RUN = "tensorboard"  # TensorBoard names a run by its folder under --logdir (the run folder here)


class TensorBoard:
    """A `tensorboard` server over `logdir` on a loopback port, asked through its HTTP API."""

    def __init__(self, logdir: Path):
        self.port = free_port()
        self.process = subprocess.Popen([PYTHON, "-m", "tensorboard.main", "--logdir", str(logdir),
                                         "--port", str(self.port), "--host", "127.0.0.1"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def get(self, path: str, body=None):
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/{path}",
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            data = response.read()
        return data if path.startswith("data/plugin/images/individualImage") else json.loads(data)

    def wait_for(self, plugin: str, tag: str, timeout: float = 120) -> None:
        """Until the server has loaded `tag` of `plugin` (it reads event files in the background)."""
        deadline = time.time() + timeout
        while True:
            assert self.process.poll() is None, self.process.communicate()[1][-2000:]
            with contextlib.suppress(urllib.error.URLError, ConnectionError):
                if tag in self.get(f"data/plugin/{plugin}/tags").get(BOARD_RUN, {}):
                    return
            assert time.time() < deadline, f"TensorBoard never served {plugin} {tag}"
            time.sleep(0.5)

    def wait_for_step(self, tag: str, step: int, timeout: float = 120) -> None:
        """Until the server has loaded scalar `tag` at `step` (a record's last step: all of it is read)."""
        self.wait_for("scalars", tag, timeout)
        deadline = time.time() + timeout
        while step not in self.scalars(tag):
            assert time.time() < deadline, f"TensorBoard never served {tag} at step {step}"
            time.sleep(0.5)

    def scalars(self, tag: str) -> Dict[int, float]:
        rows = self.get(f"data/plugin/scalars/scalars?run={BOARD_RUN}&tag={tag}")
        steps = [step for _, step, _ in rows]
        assert len(steps) == len(set(steps)), f"{tag}: a step recorded twice: {steps}"
        return {step: value for _, step, value in rows}

    def session_groups(self) -> list:
        return self.get("data/plugin/hparams/session_groups",
                        {"experimentName": "", "startIndex": 0, "sliceSize": 100, "colParams": [],
                         "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE",
                                             "STATUS_RUNNING"]})["sessionGroups"]

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


@contextlib.contextmanager
def tensorboard(logdir: Path) -> Iterator[TensorBoard]:
    server = TensorBoard(logdir)
    try:
        yield server
    finally:
        server.close()


def assert_scalars_equal_record(board: TensorBoard, rows: List[Dict[str, str]]) -> None:
    """Every numeric column of metrics.csv is a TensorBoard scalar with the same steps and values
    (TensorBoard keeps float32)."""
    for section, kept in (("train", [r for r in rows if not r["top_1"]]), ("eval", [r for r in rows if r["top_1"]])):
        columns = [c for c in kept[0] if c not in ("epoch", "step", "wall_time") and any(r[c] for r in kept)]
        for column in columns:
            expected = {int(r["step"]): float(r[column]) for r in kept if r[column]}
            got = board.scalars(f"{section}/{column}")
            assert sorted(got) == sorted(expected), f"{section}/{column}"
            assert all(np.isclose(got[s], expected[s], rtol=1e-6, atol=1e-12) for s in expected), f"{section}/{column}"
