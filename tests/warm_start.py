"""A warm start for the suite's entry-point runs: a process that has imported MindSpore and this
repository's modules once, and forks a child for each run (conftest.run), which then runs the
script as `python SCRIPT ARGS...` would, in its own process, with its own argv, environment, working
directory, output files and exit status. A run pays neither Python's nor MindSpore's start-up
(~2.5 CPU-seconds each, ~240 runs a suite).

What the fork cannot give is left to a fresh interpreter: conftest.run starts a real `python`
wherever the environment differs in what is read as a library loads (WARM_UNSAFE_PREFIXES: OpenMP
threads, MindSpore's and glog's settings, Python's own), and for anything that is not a Python
script, `-m` module or `-c` program. Nothing is shared after the fork: MindSpore's context, devices
and kernels are set up by the child, as the imports touch none of them (the repository's rule).

Protocol, JSON lines over two pipes (the file descriptors in argv): a request {argv, cwd, env,
stdout, stderr} (the two output paths) is answered {pid} as the child starts and {status, cpu_s}
when it has ended (os.wait4's status and the child's user + system seconds).
"""
import importlib
import json
import os
import pkgutil
import runpy
import signal
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Environment variables that the interpreter or a library reads as it loads (before the fork): a run
# that changes one of them gets a fresh interpreter.
WARM_UNSAFE_PREFIXES = ("PYTHON", "OMP_", "GOMP_", "KMP_", "LD_", "MALLOC_", "GLOG", "MS_", "OPENBLAS", "MKL_")
WARM_SAFE = ("PYTHONUNBUFFERED",)
# Modules a run would import for itself; PyTorch's side (src.migration.torch_*) is left to the runs that need it.
SKIPPED = ("src.migration.torch_",)


def warm_unsafe_keys(env: dict, base: dict) -> list:
    """The keys of WARM_UNSAFE_PREFIXES on which `env` differs from `base` (the warm process's)."""
    keys = set(env) | set(base)
    return sorted(key for key in keys if key.startswith(WARM_UNSAFE_PREFIXES) and key not in WARM_SAFE
                  and env.get(key) != base.get(key))


def preload() -> None:
    """Import MindSpore and every module of src/ but PyTorch's side (nothing of them runs)."""
    sys.path.insert(0, str(REPO))
    from src.openmp import set_openmp_environment
    set_openmp_environment()  # as the entry points do before MindSpore loads OpenMP, which reads it once
    import mindspore  # noqa: F401
    import mindspore.dataset  # noqa: F401
    import mindspore.train  # noqa: F401

    import src
    for module in pkgutil.walk_packages(src.__path__, "src."):
        if not module.name.startswith(SKIPPED):
            importlib.import_module(module.name)


def run_child(request: dict) -> int:
    """In the forked child: become `python ARGV...` and run it; its exit status."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    import numpy as np
    np.random.seed()  # a fresh process's global generator is seeded from the OS, not the warm one's
    argv = request["argv"][1:]
    try:
        if argv[0] == "-c":
            sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif argv[0] == "-m":
            sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
            sys.modules.pop(argv[1], None)  # preloaded: runs afresh as __main__, as `python -m` would
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(os.path.abspath(argv[0]), run_name="__main__")  # __file__ absolute, as Python's
        return 0
    except SystemExit as stop:
        code = stop.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return 130
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        traceback.print_exc()
        return 1


def serve(requests, replies) -> int:
    """Fork a child per request until the requests end; in a child, its exit status (the caller exits)."""
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            return run_child(request)
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status, usage = os.wait4(pid, 0)
        replies.write(json.dumps({"status": status, "cpu_s": usage.ru_utime + usage.ru_stime}) + "\n")
        replies.flush()
    return 0


def main() -> int:
    preload()
    requests = os.fdopen(int(sys.argv[1]), "r", encoding="utf-8")
    replies = os.fdopen(int(sys.argv[2]), "w", encoding="utf-8")
    replies.write(json.dumps({"ready": os.getpid()}) + "\n")
    replies.flush()
    code = serve(requests, replies)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())  # in a child too: the interpreter ends as the run's would, exit handlers and all
