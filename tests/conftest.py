"""Shared fixtures: the repository on sys.path, fast CPU convolutions, small generated datasets."""
import csv
import fcntl
import gc
import hashlib
import importlib.util
import json
import locale
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import pytest

REPO = Path(__file__).resolve().parents[1]
# Variables that libraries this process loads set in its environment for their own sake, at whatever
# moment a test first loads them: OpenCV's import and MindSpore's CPU plugin prepend their folders to
# LD_LIBRARY_PATH, scikit-learn's import sets two of Intel OpenMP's. A run is started with the values
# this process started with (a user's shell has none of them), unless the test set its own: what a
# test process happens to hold then neither reaches the run nor makes it differ from the warm
# process's environment, which would start every later run of the worker cold.
LIBRARY_SET = ("LD_LIBRARY_PATH", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK")
STARTED_WITH = {name: os.environ.get(name) for name in LIBRARY_SET}
PYTHON = sys.executable
# The PyTorch-side tests (conversion, parity, references) need its CPU-only build, which the index
# has for x86_64 alone: requirements-dev.txt installs none on aarch64, and those tests skip there.
NO_TORCH = "PyTorch is not installed (requirements-dev.txt installs its CPU-only build on x86_64 only)"
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason=NO_TORCH)
# curves.png, the report's two pictures and train_parity.py's loss.png cost about a second of
# matplotlib each: the tests that do not look at them run without (test_resume and test_train_parity
# check both ways; the shared sample run draws them for the tests of the report and TensorBoard).
NO_CURVES = ["--plot_curves", "False"]
sys.path.insert(0, str(REPO))
os.environ.setdefault("GLOG_v", "3")

from warm_start import TORCH_FLAG, warm_unsafe_keys  # noqa: E402

from src.data.sample_data import write_sample_data  # noqa: E402
from src.device import prefer_fast_cpu_convolutions  # noqa: E402

prefer_fast_cpu_convolutions()
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers run tests side by side: each test's MindSpore kernels take one thread (src/device.py
    # reads OMP_NUM_THREADS). A small training run took the same time on one core as on two, with
    # ~16% less CPU time, and the workers do not fight over the cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# The tests' own MindSpore ops (PyNative networks, optimizer steps, gradients) run synchronously, on the
# calling thread: with MindSpore's default asynchronous dispatch the calling thread spun waiting for
# its queue threads, and test_train_step, test_resnet, test_optimizer and test_loss took 14% more CPU
# time (60.5 against 52.0 CPU-s, the same results). The entry points do the same (src/device.py).
import mindspore  # noqa: E402 - after the settings it reads as it loads

mindspore.runtime.launch_blocking()


# The folder the xdist workers of one suite run share (set for xdist runs): what is built once
# per run (`built_once`).
SHARED = "RESNET_TESTS_SHARED"


def pytest_configure(config):
    """The xdist controller makes the folder its workers share, and removes it at the end; the
    first process of a run empties the work record file (the workers append to it), so a file
    named again holds this run alone."""
    # A suite started in the background of a non-interactive shell (`bash .ci/run &`) inherits SIGINT
    # ignored, and so would every run it starts fresh, which SIGINT then never stops: a user's
    # interpreter (and a warm run, tests/warm_start.py) starts with Python's own handler instead.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get(WORK) and not os.environ.get("PYTEST_XDIST_WORKER"):
        open(os.environ[WORK], "w", encoding="utf-8").close()
    if not os.environ.get("PYTEST_XDIST_WORKER") and config.getoption("numprocesses", None):
        folder = tempfile.mkdtemp(prefix="resnet-tests-")
        os.environ[SHARED] = folder  # the workers start after this and inherit it
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


def _shared_folder() -> Optional[str]:
    return os.environ.get(SHARED) if os.environ.get("PYTEST_XDIST_WORKER") else None


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder `name`, filled by `build(folder)` once per suite run: the first worker to ask
    builds it under a file lock, the others wait and read it. Never reused by another run (the
    shared folder is this run's); a build that raised is started afresh by the next to ask."""
    shared = _shared_folder()
    root = Path(shared) / "built" if shared else tmp_path_factory.getbasetemp() / "built"
    root.mkdir(parents=True, exist_ok=True)
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


def trained_once(tmp_path_factory, args: List[str]) -> Tuple[Path, str]:
    """The output folder and stdout of a training command (`args` without --output_dir), run once
    per suite run for every test that only reads what it wrote (keyed by the exact command)."""
    key = hashlib.sha256(json.dumps(args).encode()).hexdigest()[:16]

    def train(folder: Path) -> None:
        result = run(list(args) + ["--output_dir", str(folder / "out")])
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        (folder / "stdout.txt").write_text(result.stdout, encoding="utf-8")

    folder = built_once(tmp_path_factory, f"train-{key}", train)
    return folder / "out", (folder / "stdout.txt").read_text(encoding="utf-8")


# Before everything, the modules whose pipelines fork the worker process itself (the worker
# processes of create_dataset: 213 forks in test_dataset, 36 in test_mindrecord, 0-9 in the other
# data and export modules counted): a fork costs more the larger the process, and the modules
# that build networks in the worker grow it by gigabytes (test_dataset alone 10 CPU-s, after
# them 26-46).
FORKS_FIRST = ("test_dataset", "test_mindrecord")
# Then the modules that take longest (seconds of one worker, measured on a Zen 4: test_resume 142 ...
# test_quantize 21), longest first, so that no long module is left for one worker at the end
# while the other idles (scripts/run_tests.sh passes --no-loadscope-reorder so xdist keeps this order).
LONGEST_FIRST = ("test_resume", "test_distributed", "test_rank_statistics", "test_train_parity", "test_compression",
                 "test_benchmark", "test_zoo_configs", "test_pruning", "test_warm_start", "test_watch", "test_zoo",
                 "test_multinode", "test_export", "test_cpu_layers_convolution", "test_train_step",
                 "test_convert_torch", "test_report", "test_faults", "test_resnet",
                 "test_end_to_end", "test_quantize")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(FORKS_FIRST + LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__ if item.module else "", len(rank)))


def pytest_collection_finish(session):
    """Every test module and what it imports (MindSpore, PyTorch) is loaded now and stays: frozen, the
    cyclic collector no longer walks it at each collection of the tests that compile graphs in this
    process (as the entry points' run_cli does for theirs)."""
    gc.freeze()


# The suite's work per test, written when RESNET_TESTS_WORK names a file (one JSON line per test;
# tests/work_table.py sums them per module into docs/testing.md's table, or lists the costliest):
# CPU seconds of the test process and of the processes it started and waited for (the module
# fixtures it set up included), wall seconds, when it started and on which xdist worker, and the
# runs of the project's entry points started through `run` (trainings among them; each run's
# entry point, CPU seconds and exit code in `run_list`).
WORK = "RESNET_TESTS_WORK"
TRAINING_ENTRIES = ("train.py", "fine_tune.py", "train_parity.py", "run_standalone_train.sh",
                    "run_distribute_train.sh", "tools/benchmark_learning.py")
_work: dict = {}  # test id -> its record


def _cpu_seconds() -> float:
    """This process's CPU seconds and its finished children's, warm-started runs included."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + sum(w.cpu_s for w in _WARM.values())


def _test_work(test: str) -> dict:
    return _work.setdefault(test, {"module": Path(test.split("::")[0]).stem, "test": test, "tests": 1,
                                   "cpu_s": 0.0, "wall_s": 0.0, "start": 0.0, "runs": 0, "trainings": 0,
                                   "worker": os.environ.get("PYTEST_XDIST_WORKER", "")})


def _count_run(args: List[str], cpu_s: float, returncode: int, warm: bool, refused: str = "") -> None:
    test = os.environ.get("PYTEST_CURRENT_TEST", "")  # "<test id> (<phase>)"
    if test:
        work = _test_work(test.rsplit(" (", 1)[0])
        work["runs"] += 1
        work["trainings"] += any(str(arg).endswith(TRAINING_ENTRIES) for arg in args)
        work.setdefault("run_list", []).append({"entry": _entry_name(args), "args": [str(arg) for arg in args[1:]],
                                                "cpu_s": round(cpu_s, 2), "returncode": returncode, "warm": warm,
                                                **({"warm_refused": refused} if refused else {})})


def _entry_name(args: List[str]) -> str:
    """What a command runs: `python -m`'s module, else its script, else its program."""
    args = [str(arg) for arg in args]
    if "-m" in args[:2]:
        return args[args.index("-m") + 1]
    return next((Path(arg).name for arg in args if arg.endswith((".py", ".sh"))), Path(args[0]).name)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown of each test (module fixtures it starts included), measured."""
    start_cpu, start_wall = _cpu_seconds(), time.time()
    yield
    work = _test_work(item.nodeid)
    work.update(cpu_s=_cpu_seconds() - start_cpu, wall_s=time.time() - start_wall, start=start_wall)


def pytest_sessionfinish(session):
    for warm in _WARM.values():
        warm.close()
    path = os.environ.get(WORK)
    if path and _work:
        with open(path, "a", encoding="utf-8") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            for work in _work.values():
                handle.write(json.dumps(work) + "\n")


@pytest.fixture(scope="session")
def sample_root(tmp_path_factory) -> Path:
    """Sample data in both formats: 20 training images per class, a test split of 101 (odd) images;
    one copy for the whole run (tests read it, never write it), so trainings on it can be shared."""
    return built_once(tmp_path_factory, "sample",
                      lambda root: write_sample_data(str(root), train_per_class=20, test_total=101, seed=0))


@pytest.fixture(scope="session")
def cifar_dir(sample_root) -> Path:
    return sample_root / "cifar10"


@pytest.fixture(scope="session")
def folder_dir(sample_root) -> Path:
    return sample_root / "imagenet"


@pytest.fixture(scope="session")
def float_ckpt(tmp_path_factory) -> Path:
    """A float checkpoint of resnet10 with 10 classes, what compression starts from (fresh weights:
    the tests of compression's wiring do not depend on them)."""
    import mindspore as ms

    from src.resnet import create_model
    path = tmp_path_factory.mktemp("float") / "float.ckpt"
    ms.save_checkpoint(create_model("resnet10", num_classes=10), str(path))
    return path


@pytest.fixture(scope="session")
def sample_run(tmp_path_factory, cifar_dir) -> Tuple[Path, str]:
    """Two epochs of the sample config on resnet10, the smallest of the family (12 steps each,
    clipping on) with evaluation, its report, and the profiler over 3 steps: the run folder and
    stdout, trained once per suite run for the tests that read a finished run (TensorBoard, the
    report, the profiler's files)."""
    out, stdout = trained_once(tmp_path_factory, [
        PYTHON, "train.py", "--config_path", str(REPO / "config" / "sample_resnet18.yaml"), "--net_name", "resnet10",
        "--data_path", str(cifar_dir), "--batch_size", "16", "--lr_max", "0.05", "--warmup_epochs", "0",
        "--clip_grad_norm", "1.0", "--epoch_size", "2", "--run_eval", "True", "--log_interval", "4",
        "--enable_profiling", "True", "--profile_steps", "3"])
    return out / "resnet10" / "cifar10", stdout


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


def run_environment(env: Mapping[str, str]) -> dict:
    """`env` for a run: unbuffered, and LIBRARY_SET as this process started with them where the test
    did not set its own."""
    full_env = dict(env, PYTHONUNBUFFERED="1")
    for name, started in STARTED_WITH.items():
        if full_env.get(name) == os.environ.get(name):
            full_env.pop(name, None)
            if started is not None:
                full_env[name] = started
    return full_env


def run(args: List[str], cwd: Optional[Path] = None, timeout: int = 600,
        env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """Run a command of the project (python scripts or bash launchers) and capture its output.

    `env` replaces the inherited environment when given. A Python run starts from the warm process
    (tests/warm_start.py: a fork that has MindSpore imported, made to be what a fresh interpreter
    would be) where nothing it changes is read before the fork; RESNET_TESTS_COLD=1 starts every run
    as a fresh interpreter. A run the warm process refuses (its reason in the work record and a
    warning) starts fresh."""
    full_env = run_environment(os.environ if env is None else env)
    cwd = str(cwd or REPO)
    warm_process, refused = _warm_for(args, full_env)
    warm = refused is None and os.path.isdir(cwd)
    if warm:
        try:
            result = warm_process.run(args, cwd, full_env, timeout)
        except WarmStartRefused as refusal:
            warm, refused = False, str(refusal)
            if refused not in _refusals_told:
                _refusals_told.add(refused)
                warnings.warn(f"warm start refused, running fresh: {refused}", stacklevel=2)
    if not warm:
        children = _children_cpu_s()
        result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)
        _count_run(args, _children_cpu_s() - children, result.returncode, False, refused or "")
    return result


def _warm_for(args: List[str], full_env: dict) -> Tuple["WarmStart", Optional[str]]:
    """The warm process for `args`, and None where it may start them, else why not ("" for what
    always starts fresh: a command that is not a Python script, `-m` or `-c`, and RESNET_TESTS_COLD=1)."""
    warm_process = _WARM[_entry_name(args) in TORCH_ENTRIES]
    if not _python_run(args) or os.environ.get(COLD) == "1":
        return warm_process, ""
    # A warm start fits this interpreter with nothing changed that the interpreter or a library reads as it loads.
    differing = warm_unsafe_keys(full_env, warm_process.environment())
    return warm_process, f"the environment differs from the warm process's in {', '.join(differing)}" if differing \
        else None


def _python_run(args: List[str]) -> bool:
    """Whether `args` runs this interpreter on a script, `-m` module or `-c` program."""
    args = [str(arg) for arg in args]
    return len(args) >= 2 and args[0] == PYTHON and (args[1] in ("-c", "-m") and len(args) > 2
                                                      or args[1].endswith(".py"))


class WarmStartRefused(Exception):
    """The warm process will not run a command (the message says why): it runs fresh."""


_refusals_told: set = set()


class WarmStart:
    """This worker's warm process (tests/warm_start.py), started at its first run and ended with the
    session, its CPU time and its children's then counted in this process's (RUSAGE_CHILDREN).

    Each run writes to two FIFOs of its own, read here until every process holding them has closed
    them (the run's, and any it started that outlives it), as subprocess.run reads its pipes: a write
    end held here until the run's exit status arrives keeps the reads from ending before the run
    opens them. On `timeout` the run is killed (if still running) and subprocess.TimeoutExpired
    raised with what was read, as subprocess.run does. The warm process refuses a run it cannot fork
    faithfully (a thread besides its own, a preloaded library the run's first sys.path entry would
    shadow), and is refused for the session when its imports printed anything (a fresh run would
    print that where it imports them)."""

    def __init__(self, with_torch: bool = False):
        self.with_torch = with_torch  # PyTorch imported too (warm_start.py --torch)
        self.process: Optional[subprocess.Popen] = None
        self.requests, self.replies, self.pending = None, -1, b""
        self.started_env: dict = {}
        self.cpu_s = 0.0  # the finished runs' CPU seconds, until the warm process is waited for
        self.folder = ""
        self.runs = 0
        self.refusal = ""  # why no run may start warm this session
        self.running: Optional["WarmRun"] = None  # the run started last

    def environment(self) -> dict:
        """The environment the warm process started with (this worker's, unbuffered), or will start
        with: a test that changes os.environ later does not change what the warm process loaded."""
        return self.started_env or run_environment(os.environ)

    def _start(self) -> None:
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        self.started_env = self.started_env or run_environment(os.environ)  # a restart: as first
        self.process = subprocess.Popen([PYTHON, str(REPO / "tests" / "warm_start.py"), str(request_read),
                                         str(reply_write), *([TORCH_FLAG] if self.with_torch else [])],
                                        pass_fds=(request_read, reply_write),
                                        env=self.started_env, cwd=str(REPO))
        os.close(request_read)
        os.close(reply_write)
        self.requests = os.fdopen(request_write, "w", encoding="utf-8")
        self.replies, self.pending = reply_read, b""
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = tempfile.mkdtemp(prefix="warm-runs-")
        ready = self._reply(None)
        assert "ready" in ready, "the warm process did not start"
        if ready["printed"]:
            self.close()
            self.refusal = (f"importing MindSpore and src/ printed {ready['printed'][:300]!r}, which a fresh run "
                            "prints where it imports them")

    def _reply(self, timeout: Optional[float]) -> Optional[dict]:
        """The warm process's next reply, or None when none came within `timeout` seconds."""
        while b"\n" not in self.pending:
            if not select.select([self.replies], [], [], timeout)[0]:
                return None
            chunk = os.read(self.replies, 65536)
            if not chunk:
                return {"ended": True}
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def _ended(self) -> str:
        return f"the warm process ended ({self.process.wait()}); RESNET_TESTS_COLD=1 runs without it"

    def run(self, args: List[str], cwd: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
        """Run `args` as a child of the warm process: its result as subprocess.run's (its CPU seconds
        go into the work record as it ends, WarmRun)."""
        started = self.start(args, cwd, env)
        try:
            started.communicate(timeout)
        except subprocess.TimeoutExpired:
            started.kill()  # as subprocess.run does: the run ends, and what it wrote is raised with it
            started.stop_reading()
            raise subprocess.TimeoutExpired(args, timeout, *started.output) from None
        return subprocess.CompletedProcess(args, started.returncode, *started.output)

    def start(self, args: List[str], cwd: str, env: dict, merge_stderr: bool = False,
              new_session: bool = False) -> "WarmRun":
        """Start `args` as a child of the warm process (its stderr into its stdout with
        `merge_stderr`, in a session of its own with `new_session`) and return at once."""
        if not self.refusal and (self.process is None or self.process.poll() is not None):
            self._start()
        if self.refusal:
            raise WarmStartRefused(self.refusal)
        if self.running is not None and self.running.poll() is None:
            raise WarmStartRefused("the warm process is running another command")  # it waits for one at a time
        self.runs += 1
        paths = [os.path.join(self.folder, f"{self.runs}.{name}") for name in ("stdout", "stderr")[:2 - merge_stderr]]
        readers: List[int] = []
        held: List[int] = []  # write ends, closed when the run's exit status has come
        try:
            for path in paths:
                os.mkfifo(path, 0o600)
                readers.append(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
                held.append(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            self.requests.write(json.dumps({"argv": [str(arg) for arg in args], "cwd": cwd, "env": env,
                                            "stdout": paths[0], "stderr": paths[-1],
                                            "new_session": new_session}) + "\n")
            self.requests.flush()
            reply = self._reply(None)
            if "refused" in reply:
                raise WarmStartRefused(reply["refused"])
            assert "pid" in reply, self._ended()
        except BaseException:
            for fd in readers + held:
                os.close(fd)
            for path in paths:
                Path(path).unlink(missing_ok=True)
            raise
        self.running = WarmRun(self, args, reply["pid"], readers, held, paths)
        return self.running

    def close(self) -> None:
        """End the warm process and wait for it (its children's CPU time then counts as this process's)."""
        if self.process is None:
            return
        self.requests.close()
        self.process.wait()
        os.close(self.replies)
        shutil.rmtree(self.folder, ignore_errors=True)
        self.process, self.cpu_s, self.folder = None, 0.0, ""


class WarmRun:
    """A run of the warm process while it runs: as much of subprocess.Popen (text mode, its output
    captured) as the tests use. Its output is two FIFOs of its own (one with merged stderr), read
    until every process holding them has closed them; its exit status and CPU seconds come from the
    warm process, which waits for it (pid), and are counted in the work record when they come."""

    def __init__(self, warm: WarmStart, args: List[str], pid: int, readers: List[int], held: List[int],
                 paths: List[str]):
        self.warm, self.args, self.pid = warm, args, pid
        self.readers, self.held, self.paths = readers, held, paths
        try:
            self.pidfd: Optional[int] = os.pidfd_open(pid)  # signals this run, never another that took its pid
        except ProcessLookupError:
            self.pidfd = None  # ended and reaped already: its status is on the way
        self.data = {fd: bytearray() for fd in readers}
        self.reading = set(readers)
        self.returncode: Optional[int] = None
        self.cpu_s = 0.0

    @property
    def output(self) -> Tuple[Optional[str], Optional[str]]:
        """(stdout, stderr) as subprocess's text mode decodes them; stderr None when merged."""
        text = [bytes(self.data[fd]).decode(locale.getpreferredencoding(False)).replace("\r\n", "\n")
                .replace("\r", "\n") for fd in self.readers]
        return text[0], text[1] if len(text) > 1 else None

    def _pump(self, timeout: Optional[float]) -> None:
        """Read what has come within `timeout` seconds: output, and the exit status once."""
        ready = select.select([*self.reading] + ([self.warm.replies] if self.returncode is None else []), [], [],
                              timeout)[0]
        if self.warm.replies in ready:
            self._ended(self.warm._reply(0))
        for fd in set(ready) & self.reading:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            self.data[fd] += chunk
            if not chunk:
                self.reading.discard(fd)
                os.close(fd)

    def _ended(self, reply: Optional[dict]) -> None:
        if reply is None:
            return
        assert "status" in reply, self.warm._ended()
        self.returncode, self.cpu_s = os.waitstatus_to_exitcode(reply["status"]), reply["cpu_s"]
        self.warm.cpu_s += self.cpu_s
        for fd in self.held:
            os.close(fd)  # from now on a read ends when the run's processes have closed theirs
        self.held.clear()
        for path in self.paths:
            Path(path).unlink(missing_ok=True)  # opened by the run as it started
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        _count_run(self.args, self.cpu_s, self.returncode, True)

    def poll(self) -> Optional[int]:
        self._pump(0)
        return self.returncode

    def stop_reading(self) -> None:
        """Wait for its exit status, then stop reading what its processes left behind may still write."""
        while self.returncode is None:
            self._pump(None)
        for fd in self.reading:
            os.close(fd)
        self.reading.clear()

    def communicate(self, timeout: Optional[float] = None) -> Tuple[Optional[str], Optional[str]]:
        """Its output once it has ended and every process holding its output has closed it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None or self.reading:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout, *self.output)
            self._pump(left)
        return self.output

    def wait(self, timeout: Optional[float] = None) -> int:
        """Its exit code; unlike Popen.wait, once its output is read to the end too (communicate)."""
        self.communicate(timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None and self.pidfd is not None:
            signal.pidfd_send_signal(self.pidfd, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(args: List[str], env: Optional[dict] = None, merge_stderr: bool = False,
          new_session: bool = False) -> "Started":
    """Start a command of the project in the repository and return at once (for a test that signals it
    while it runs): from the warm process where conftest.run would start it warm, else fresh, as
    subprocess.Popen(text=True) with stdout and stderr piped (`merge_stderr`: stderr into stdout;
    `new_session`: start_new_session). Its run is counted in the work record when it has ended."""
    full_env = run_environment(os.environ if env is None else env)
    warm_process, refused = _warm_for(args, full_env)
    if refused is None:
        try:
            return warm_process.start(args, str(REPO), full_env, merge_stderr, new_session)
        except WarmStartRefused as refusal:
            refused = str(refusal)
    return FreshRun(args, refused, cwd=REPO, env=full_env, text=True, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, start_new_session=new_session)


class FreshRun(subprocess.Popen):
    """subprocess.Popen, its run counted in the work record once it has been waited for."""

    def __init__(self, args: List[str], refused: str, **options):
        self.refused, self.counted, self.children_before = refused, False, _children_cpu_s()
        super().__init__(args, **options)

    def wait(self, timeout: Optional[float] = None) -> int:
        returncode = super().wait(timeout)
        if not self.counted:
            self.counted = True
            _count_run(self.args, _children_cpu_s() - self.children_before, returncode, False, self.refused)
        return returncode


Started = Union[WarmRun, FreshRun]  # what start() returns


def _children_cpu_s() -> float:
    """The CPU seconds of this process's children waited for so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# The entry points that import PyTorch start from a warm process that has imported it too; the rest
# from one that has not (a fresh run of them never loads it).
TORCH_ENTRIES = ("train_parity.py", "src.migration.parity", "src.migration.convert_torch",
                 "src.migration.augment_reference")
_WARM = {False: WarmStart(), True: WarmStart(with_torch=True)}
COLD = "RESNET_TESTS_COLD"


def wait_for_step(folder: Path, step: int, process: Started, timeout: float = 300) -> None:
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


def train_args(base: Sequence[str], data: Path, out: Path, *extra: str) -> List[str]:
    """train.py's command line on `data` into `out`: a module's `base` options, then the test's `extra`."""
    return [PYTHON, "train.py", "--data_path", str(data), "--output_dir", str(out), *base, *extra]


def read_metrics(folder_or_path: Path) -> List[Dict[str, str]]:
    """The rows of a run record: metrics.csv in the run folder given, or the CSV file given."""
    path = Path(folder_or_path)
    if path.is_dir():
        path = path / "metrics.csv"
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def last_json(stdout: str) -> dict:
    """The JSON report a command prints as the last line of its stdout."""
    return json.loads(stdout.strip().splitlines()[-1])


def one_line_error(result: subprocess.CompletedProcess, returncode: int = 2, alone: bool = True) -> str:
    """The one `error: ` line of a refused command that exited `returncode` (`alone`: all of stderr)."""
    if alone:
        lines = result.stderr.strip().splitlines()
    else:  # warnings may come before it
        lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == returncode, f"rc {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    return lines[0]
