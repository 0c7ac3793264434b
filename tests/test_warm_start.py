"""A warm-started run (tests/warm_start.py, through conftest.run) is what a fresh interpreter's is:
entry points and programs that succeed, fail, are interrupted, warn, leave a process behind or look
at their own interpreter run both ways, one after the other in the same folder, and their exit
codes, stderr lines, stdout and files written (names and bytes) must be the same, after taking out
what varies from run to run (VARYING: times and durations)."""
import functools
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import pytest

import conftest
from conftest import COLD, NO_CURVES, PYTHON, REPO, read_metrics, run
from src.data.sources import CIFAR_RECORD_BYTES

pytestmark = pytest.mark.slow  # starts entry points: not in the quick tier

CONFIG = REPO / "config" / "sample_resnet18.yaml"
# What differs between two runs of the same command, however started: what takes time.
VARYING = [(re.compile(r"\d+(\.\d+)? img/s"), "<rate> img/s"),
           (re.compile(r"\b\d+(\.\d+)?s\b"), "<seconds>s"),
           (re.compile(r"eta \d+:\d\d:\d\d"), "eta <eta>"),
           (re.compile(r"(data wait|waiting for data) \d+%"), r"\1 <share>%")]
TIMING_COLUMNS = ("img_per_s", "wall_time", "data_wait")  # metrics.csv's measured columns
EVENTS = re.compile(r"events\.out\.tfevents\.\d+\..*")  # TensorBoard's: events.out.tfevents.TIME.HOST.PID
Run = Tuple[int, List[str], List[str], dict]


def normalized(text: str) -> List[str]:
    for pattern, replacement in VARYING:
        text = pattern.sub(replacement, text)
    return text.splitlines()


def files(folder: Path) -> dict:
    """The files under `folder` by relative name: their bytes; metrics.csv's rows without the timing
    columns; a TensorBoard events file by its name alone (wall times in every record)."""
    found = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = EVENTS.sub("events.out.tfevents.<time>.<host>.<pid>", str(path.relative_to(folder)))
        if EVENTS.match(path.name):
            found[name] = None
        elif path.name == "metrics.csv":
            found[name] = [{key: value for key, value in row.items() if key not in TIMING_COLUMNS}
                           for row in read_metrics(path)]
        else:
            found[name] = path.read_bytes()
    return found


def warm_and_fresh(monkeypatch, args: List[str], folder: Path, cwd: Optional[Path] = None,
                   prepare: Callable[[], None] = lambda: None, extra_env: Optional[dict] = None,
                   refused: str = "") -> Tuple[Run, Run]:
    """Run `args` (with `extra_env`) warm, then fresh, each in an emptied `folder` (prepared by
    `prepare`): exit code, stderr and stdout lines, and the files it left in `folder`. With `refused`,
    the warm process must refuse the first run, for a reason that says it."""
    env = {key: value for key, value in os.environ.items() if key != COLD}
    env.update(extra_env or {})
    results = []
    for cold in (False, True):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        prepare()
        if cold:
            monkeypatch.setenv(COLD, "1")
        else:
            monkeypatch.delenv(COLD, raising=False)
        result = run(args, cwd=cwd, env=env)
        record = conftest._work[os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]]["run_list"][-1]
        if refused and not cold:
            assert not record["warm"] and refused in record["warm_refused"], record
        else:
            assert record["warm"] is not cold, record  # the warm run did start warm
        results.append((result.returncode, normalized(result.stderr), normalized(result.stdout),
                        files(folder)))
    monkeypatch.delenv(COLD, raising=False)
    return results[0], results[1]


def assert_same(warm: Run, fresh: Run) -> None:
    assert warm[0] == fresh[0], (warm[1][-20:], fresh[1][-20:])
    assert warm[1] == fresh[1]  # stderr
    assert warm[3] == fresh[3]  # files
    assert warm[2] == fresh[2]  # stdout


def test_entry_points_run_warm_as_fresh(monkeypatch, tmp_path, cifar_dir):
    """train.py finishing an epoch of resnet10 (2 steps), eval.py refusing a corrupt checkpoint,
    export.py refusing AIR on the CPU."""
    data = tmp_path / "data"
    data.mkdir()
    records = b"".join(path.read_bytes() for path in sorted(cifar_dir.glob("data_batch_*.bin")))
    (data / "data_batch_1.bin").write_bytes(records[:32 * CIFAR_RECORD_BYTES])
    shutil.copy(cifar_dir / "test_batch.bin", data / "test_batch.bin")
    out = tmp_path / "run"
    train = [PYTHON, "train.py", "--config_path", str(CONFIG), "--net_name", "resnet10", "--data_path", str(data),
             "--batch_size", "16", "--epoch_size", "1", "--warmup_epochs", "0", "--run_eval", "False",
             "--output_dir", str(out), *NO_CURVES]
    warm, fresh = warm_and_fresh(monkeypatch, train, out)
    assert warm[0] == 0, warm[1][-20:]
    assert_same(warm, fresh)

    kept = tmp_path / "resnet10.ckpt"
    shutil.copy(out / "resnet10" / "cifar10" / "resnet10-1_2.ckpt", kept)
    broken = out / "broken.ckpt"
    evaluate = [PYTHON, "eval.py", "--config_path", str(CONFIG), "--net_name", "resnet10",
                "--data_path", str(cifar_dir), "--checkpoint_file_path", str(broken)]
    warm, fresh = warm_and_fresh(monkeypatch, evaluate, out, prepare=lambda: broken.write_bytes(b"not a checkpoint"))
    assert warm[0] == 2, warm[1]
    assert_same(warm, fresh)

    export = [PYTHON, "export.py", "--config_path", str(CONFIG), "--net_name", "resnet10", "--checkpoint_file_path",
              str(kept), "--file_format", "AIR", "--file_name", str(out / "air" / "resnet10")]
    warm, fresh = warm_and_fresh(monkeypatch, export, out)
    assert warm[0] == 2, warm[1]
    assert_same(warm, fresh)


# A process left behind: it writes once the program that started it (pid in argv) has ended.
ORPHAN = """import os, sys, time
while os.getppid() == int(sys.argv[1]):
    time.sleep(0.02)
print("orphan", file=sys.stderr)
open("late.txt", "w").close()
"""
PROGRAMS = {
    # an uncaught KeyboardInterrupt: traceback, exit handlers, then death by SIGINT
    "interrupted": ("import atexit\natexit.register(print, 'exit handler ran')\nraise KeyboardInterrupt('stop')\n", -2),
    # warnings: shown once per place, a DeprecationWarning in __main__, one from a preloaded module
    "warns": ("import warnings\nimport numpy as np\n"
              "def warn():\n    warnings.warn('once per place')\n"
              "warn()\nwarn()\nwarnings.warn('old', DeprecationWarning)\nnp.mean([])\n", 0),
    # a process it starts outlives it: writes to stderr and a file once it has been orphaned
    "leaves a process": ("import os, subprocess, sys\n"
                         f"subprocess.Popen([sys.executable, '-S', '-c', {ORPHAN!r}, str(os.getpid())])\n"
                         "print('child ends', file=sys.stderr)\n", 0),
    # its end in C: a file written through C stdio's buffer and never closed, a C exit handler of its own
    "ends in C": ("import ctypes\nlibc = ctypes.CDLL(None)\n"
                  "libc.fopen.restype = libc.strdup.restype = ctypes.c_void_p\n"
                  "libc.fputs(b'left in the buffer', ctypes.c_void_p(libc.fopen(b'unclosed.txt', b'w')))\n"
                  "libc.__cxa_atexit(ctypes.cast(libc.puts, ctypes.c_void_p), "
                  "ctypes.c_void_p(libc.strdup(b'printed by its exit handler')), None)\n", 0),
}


@pytest.mark.parametrize("name", PROGRAMS)
def test_programs_run_warm_as_fresh(monkeypatch, tmp_path, name):
    program, returncode = PROGRAMS[name]
    folder = tmp_path / "cwd"
    warm, fresh = warm_and_fresh(monkeypatch, [PYTHON, "-c", program], folder, cwd=folder)
    assert warm[0] == returncode, warm[1]
    if name == "ends in C":  # what exit() does in C, seen in the fresh run
        assert fresh[3] == {"unclosed.txt": b"left in the buffer"} and fresh[2] == ["printed by its exit handler"]
    assert_same(warm, fresh)


# Runs until it is signalled, once it has written to stdout and stderr and made the file in argv.
SIGNALLED = """import sys, time
print('to stdout', flush=True)
print('to stderr', file=sys.stderr, flush=True)
print('to stdout again', flush=True)
open(sys.argv[1], 'w').close()
while True:
    time.sleep(0.02)
"""


def wait_until_asleep(pid: int, deadline: float) -> None:
    """Until `pid` sleeps (state S): in SIGNALLED's loop, past the statement that makes its file, so
    a SIGINT's traceback names the same line warm and fresh. (Preempted inside that statement, a
    warm run under load was signalled there once: its traceback named line 5, the fresh one's 7.)"""
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "S":
        assert time.monotonic() < deadline, f"run {pid} never went to sleep"
        time.sleep(0.005)


@pytest.mark.parametrize("signum, new_session", [(signal.SIGTERM, False), (signal.SIGINT, True)])
def test_a_started_run_is_signalled_as_a_fresh_one(monkeypatch, tmp_path, signum, new_session):
    """conftest.start, warm and fresh: stderr merged into stdout in the order written, the run signalled
    while it runs (SIGINT to its whole session, as Ctrl-C is), its exit and output as a fresh run's."""
    outcomes = []
    for cold in (False, True):
        ready = tmp_path / f"ready-{cold}"
        if cold:
            monkeypatch.setenv(COLD, "1")
        else:
            monkeypatch.delenv(COLD, raising=False)
        process = conftest.start([PYTHON, "-c", SIGNALLED, str(ready)], merge_stderr=True, new_session=new_session)
        assert isinstance(process, conftest.WarmRun) is not cold
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.02)
        wait_until_asleep(process.pid, deadline)
        if new_session:
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)
        outcomes.append((*process.communicate(timeout=60), process.wait()))
    monkeypatch.delenv(COLD, raising=False)
    assert outcomes[0] == outcomes[1]
    output, stderr, returncode = outcomes[0]
    assert returncode == -signum and stderr is None
    assert output.splitlines()[:3] == ["to stdout", "to stderr", "to stdout again"]


# Side effects a C exit handler could have: writes, files made or changed, messages, signals.
SIDE_EFFECTS = ("write,writev,pwrite64,pwritev,pwritev2,open,openat,creat,unlink,unlinkat,rename,renameat,renameat2,"
                "mkdir,mkdirat,rmdir,truncate,ftruncate,fsync,fdatasync,connect,sendto,sendmsg,kill,tkill,tgkill,"
                "exit_group")
EXIT_MARK = "the C exit handlers registered before this point begin"
# A fresh interpreter that imports what the PyTorch warm process imports, registers a C exit handler
# that writes EXIT_MARK (where a warm child registers its end), and runs train.py as `python train.py`.
FORKED_HERE = f"""import ctypes, runpy, sys
sys.path.insert(0, {str(REPO / "tests")!r})
import warm_start
warm_start.preload(with_torch=True)
libc = ctypes.CDLL(None)
libc.strdup.restype = ctypes.c_void_p
libc.__cxa_atexit(ctypes.cast(libc.perror, ctypes.c_void_p), ctypes.c_void_p(libc.strdup({EXIT_MARK.encode()!r})), None)
sys.argv, sys.path[0] = sys.argv[1:], {str(REPO)!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.skipif(not shutil.which("strace"), reason="strace is not installed (apt-get install strace)")
def test_the_exit_handlers_a_warm_run_skips_do_nothing_in_a_fresh_one(tmp_path, cifar_dir):
    """A warm child ends before the C exit handlers registered before the fork (warm_start.py,
    skip_preloaded_exit_handlers). In a fresh training that registers its mark where the fork would be,
    those handlers, which run after the mark, make no system call with an effect but the exit."""
    trace = tmp_path / "trace"
    out = tmp_path / "run"
    train = ["train.py", "--config_path", str(CONFIG), "--net_name", "resnet10", "--data_path", str(cifar_dir),
             "--batch_size", "100", "--epoch_size", "1", "--warmup_epochs", "0", "--run_eval", "False",
             "--output_dir", str(out), *NO_CURVES]
    result = run(["strace", "-f", "-qq", "--seccomp-bpf", "-s", "200", "-e", f"trace={SIDE_EFFECTS}", "-o", str(trace),
                  PYTHON, "-c", FORKED_HERE, *train])
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "resnet10" / "cifar10" / "resnet10-1_2.ckpt").is_file()  # it trained and saved
    calls = [line.split(None, 1)[1] for line in trace.read_text().splitlines()]
    (mark,) = [i for i, call in enumerate(calls) if EXIT_MARK in call]
    assert [call.split("(")[0] for call in calls[mark + 1:]] == ["exit_group"], calls[mark + 1:]


def test_a_run_given_a_device_is_fresh(monkeypatch, tmp_path):
    """MindSpore's context reads DEVICE_ID as it loads: a warm process loaded without it would give
    the run device 0 where a fresh one has the device it was given."""
    folder = tmp_path / "cwd"
    program = "import mindspore as ms\nprint(ms.get_context('device_id'))\n"
    warm, fresh = warm_and_fresh(monkeypatch, [PYTHON, "-c", program], folder, cwd=folder,
                                 extra_env={"DEVICE_ID": "1"}, refused="DEVICE_ID")
    assert warm[2] == ["1"], warm[1]
    assert_same(warm, fresh)


# What a program sees of its interpreter, printed as JSON (then its exit), and two draws of the
# global generators (taken out before the comparison: they must differ from run to run).
PROBE = """import json, os, random, sys
import numpy as np
try:
    import src
    found = src.__file__
except ImportError as error:
    found = repr(error)
print(json.dumps({"path": sys.path, "argv": sys.argv, "orig_argv": sys.orig_argv, "main": sorted(globals()),
                  "name": __name__, "file": globals().get("__file__"), "cwd": os.getcwd(), "src": found,
                  "spec": __spec__ and [__spec__.name, __spec__.origin],
                  "draws": [random.random(), np.random.random()]}))
"""


def test_interpreter_state_and_generators_are_fresh(monkeypatch, tmp_path):
    """sys.path, argv, __main__ and whether the repository's `src` is found, for -c in the
    repository and outside it, -m outside it and a script outside it run through a symbolic link
    (sys.path[0] is its real folder); SystemExit with a message and a code; a script that is not
    there. Every warm run draws other numbers."""
    folder = tmp_path / "cwd"
    real = tmp_path / "real"

    def prepare():
        real.mkdir(exist_ok=True)
        (real / "probe.py").write_text(PROBE + "sys.exit(3)\n")
        (real / "probe_module.py").write_text(PROBE)
        link = folder / "link"
        link.mkdir()
        (link / "probe.py").symlink_to(real / "probe.py")

    cases = [([PYTHON, "-c", PROBE + "sys.exit('the probe ends')", "an", "argument"], REPO, 1),
             ([PYTHON, "-c", PROBE], folder, 0),
             ([PYTHON, "-m", "probe_module", "--flag"], real, 0),
             ([PYTHON, str(folder / "link" / "probe.py"), "x"], folder, 3),
             ([PYTHON, str(folder / "missing.py")], folder, 2)]
    draws = []
    for args, cwd, returncode in cases:
        warm, fresh = warm_and_fresh(monkeypatch, args, folder, cwd=cwd, prepare=prepare)
        assert warm[0] == returncode, warm[1]
        if warm[2]:
            seen = [json.loads(line) for line in (warm[2][0], fresh[2][0])]
            draws.append(seen[0].pop("draws"))
            seen[1].pop("draws")
            warm, fresh = (*warm[:2], [seen[0]], warm[3]), (*fresh[:2], [seen[1]], fresh[3])
        assert_same(warm, fresh)
    assert len({draw for pair in draws for draw in pair}) == 2 * len(draws)


@pytest.mark.filterwarnings("ignore:warm start refused")  # the refusals are what it checks
def test_a_pythonpath_is_made_warm_or_refused_where_a_fresh_interpreter_would_differ(monkeypatch, tmp_path):
    """PYTHONPATH's entries (relative, empty, through '..') come before the interpreter's own, the
    repository's `src` found through them; a PYTHONPATH that shadows a preloaded library (yaml), or
    holds a sitecustomize (which a fresh interpreter runs as it starts), is run fresh."""
    folder, lib = tmp_path / "cwd", tmp_path / "lib"

    def prepare(*files: str):
        shutil.rmtree(lib, ignore_errors=True)
        lib.mkdir()
        (lib / "probe.py").write_text(PROBE)
        for name in files:
            (lib / name).write_text("import sys\nprint('planted', __name__, file=sys.stderr)\n")

    python_path = os.pathsep.join(["../lib", "", str(REPO / "src" / "..")])
    warm, fresh = warm_and_fresh(monkeypatch, [PYTHON, "-m", "probe"], folder, cwd=folder, prepare=prepare,
                                 extra_env={"PYTHONPATH": python_path})
    assert warm[0] == 0, warm[1]
    seen = [json.loads(run[2][0]) for run in (warm, fresh)]
    for probe in seen:
        assert probe["path"][:4] == [str(folder), str(lib), str(folder), str(REPO)] and probe["src"].startswith(
            str(REPO)), probe
        probe.pop("draws")
    assert_same((*warm[:2], [seen[0]], warm[3]), (*fresh[:2], [seen[1]], fresh[3]))
    for planted in ("yaml.py", "sitecustomize.py"):
        stem = planted.removesuffix(".py")
        warm, fresh = warm_and_fresh(monkeypatch, [PYTHON, "-c", "import yaml"], folder, cwd=folder,
                                     prepare=functools.partial(prepare, planted), extra_env={"PYTHONPATH": str(lib)},
                                     refused=f"PYTHONPATH has its own {stem}")
        assert warm[0] == 0 and warm[1] == [f"planted {stem}"], warm[1]
        assert_same(warm, fresh)


def test_the_parity_tool_runs_warm_beside_pytorch_as_fresh(monkeypatch, tmp_path, cifar_dir):
    """train_parity.py starts from the warm process that has imported PyTorch too: one step of
    resnet10 against PyTorch's, every table, checkpoint and line as a fresh run's."""
    out = tmp_path / "parity"
    parity = [PYTHON, "train_parity.py", "--config_path", str(CONFIG), "--net_name", "resnet10",
              "--data_path", str(cifar_dir), "--batch_size", "8", "--steps", "1", "--warmup_epochs", "0",
              "--pynative", "--output_dir", str(out), *NO_CURVES]
    before = conftest._WARM[True].runs
    warm, fresh = warm_and_fresh(monkeypatch, parity, out)
    assert warm[0] == 0, warm[1][-20:]
    assert conftest._WARM[True].runs == before + 1  # the warm run was the PyTorch process's
    assert_same(warm, fresh)
