"""A warm start for the suite's entry-point runs: a process that has imported MindSpore and this
repository's modules once, and forks a child for each run (conftest.run); with --torch, PyTorch's
side too, for the runs of the entry points that import it (conftest.TORCH_ENTRIES). A child becomes what
`python SCRIPT ARGS...` (or `-m MODULE`, `-c PROGRAM`) would be in a fresh interpreter, started by
subprocess.run(capture_output=True) with stdin from /dev/null (what pytest's capture gives a test):

- its argv, sys.orig_argv, environment, working directory, stdin and output;
- sys.path: the first entry a fresh interpreter would put (the script's real directory, the working
  directory for -m, "" for -c), the run's PYTHONPATH (each entry made absolute, as the interpreter
  makes it), then the interpreter's own entries (this process's, without the tests/ folder it was
  started from and the repository preload() added). A preloaded module of the repository (`src`) that
  the fresh run would not import from the same file (a script, -m or -c outside the repository, a
  PYTHONPATH without it) is dropped from sys.modules, to be imported again or not found, as fresh; a
  preloaded library that the run's first sys.path entry or its PYTHONPATH would shadow, or a
  sitecustomize or usercustomize on its PYTHONPATH (a fresh interpreter runs them as it starts),
  refuses the warm start;
- a fresh `__main__` module, the script compiled from its absolute path as Python's, -m through
  runpy._run_module_as_main as `python -m` calls it;
- an uncaught exception printed by sys.excepthook with the frames of this file left out, exit
  status 1; SystemExit handled by the interpreter itself; an uncaught KeyboardInterrupt printed,
  then the interpreter finalizes and kills itself with SIGINT, as CPython does;
- the global generators of `random` and numpy seeded from the OS, the warnings' registries
  (`__warningregistry__`, 'once') emptied;
- its end: the interpreter finalizes as a fresh one does (threads joined, atexit handlers, modules
  cleared), then exit() runs the C exit handlers registered since the fork (those of the libraries
  the run loaded, and the static objects it first used) and flushes C stdio, and there the child
  ends (skip_preloaded_exit_handlers).

What cannot differ: preload() prints nothing (its stdout and stderr are captured, fds and C stdio
alike; conftest refuses the warm start when they are not empty, for a fresh interpreter would print
them where its run imports MindSpore), and the fork has one thread (checked before each fork;
OpenBLAS's pool, which numpy's import starts, is stopped after the imports as fork's own handler
would stop it, and starts again in the child on its first threaded call).

What is left to a fresh interpreter: conftest.run starts a real `python` wherever the environment
differs in what is read as the interpreter or a library loads (WARM_UNSAFE_PREFIXES; PYTHONPATH is
made here, unless this process itself was started with one), and for anything that is not a Python
script, `-m` module or `-c` program.

Two differences are left. One is Python's string hash seed, fixed as an interpreter starts. It decides
hash() of str, bytes and datetime objects, and so the order in which a set of them iterates (dicts
keep insertion order). One run cannot tell it from a fresh one's: the warm process draws its own at
random, as a fresh interpreter does. The runs of one warm process share it, so two runs of one test
on one worker iterate such sets in the same order where two fresh runs may not: a test comparing
two runs could pass warm where fresh runs would show an output that depends on that order, and
cannot fail for it. The repository's rule (every random choice is a pure function of seed, epoch and
index) allows no such output, and RESNET_TESTS_COLD=1 gives every run its own seed. A run that sets
PYTHONHASHSEED is fresh (the PYTHON prefix).

The other: the C exit handlers registered before the fork, the destructors of the preloaded
libraries' static objects (MindSpore's registries, PyTorch's), do not run in a child. In the forked
heap they only free memory, each page copied on write first: ~0.1 CPU-s of every run, of the ~0.2
that a warm run of nothing costs. A fresh interpreter runs them after Python has finished;
test_warm_start.py traces a fresh training that starts as this process does, and they make no
system call with an effect but the exit.

Protocol, JSON lines over two pipes (the file descriptors in argv): this process says {ready,
printed} (what preload() printed) once; a request {argv, cwd, env, stdout, stderr, new_session} (two
FIFOs the caller reads until EOF, or one for both; a session of its own) is answered {refused} (why
the caller should run it fresh), or {pid} as the child starts and {status, cpu_s} when it has ended
(os.wait4's status and the child's user + system seconds).
"""
import builtins
import ctypes
import functools
import gc
import importlib
import importlib.machinery
import json
import os
import pkgutil
import runpy
import signal
import sys
import types
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Environment variables that the interpreter or a library reads as it loads (before the fork): a run
# that changes one of them gets a fresh interpreter. LANG and LC_* set the locale (stdio's and the
# file system's encodings), TZ the time zone (time.tzname), TMPDIR, TMP and TEMP tempfile's folder;
# MindSpore's context takes its default device_id from DEVICE_ID (read by getenv as it loads).
WARM_UNSAFE_PREFIXES = ("PYTHON", "OMP_", "GOMP_", "KMP_", "LD_", "MALLOC_", "GLOG", "MS_", "OPENBLAS", "MKL_",
                        "LANG", "LC_", "TZ", "TMP", "TEMP", "DEVICE_ID")
WARM_SAFE = ("PYTHONUNBUFFERED",)
# Read as the interpreter starts, but made in the child: the sys.path entries it adds (run_child).
MADE_IN_CHILD = "PYTHONPATH"
STARTUP_MODULES = ("sitecustomize", "usercustomize")  # what site imports from sys.path as Python starts
# Modules a run would import for itself; PyTorch's side (src.migration.torch_*) is left to the runs that need it,
# which start from a warm process of their own that has imported PyTorch too (`--torch`).
SKIPPED = ("src.migration.torch_",)
TORCH_FLAG = "--torch"
BASE_PATH: list = []  # the interpreter's own sys.path entries, after the one for the script (main sets it)
REPO_MODULES: set = set()  # the top-level modules preload() imported from the repository


def warm_unsafe_keys(env: dict, base: dict) -> list:
    """The keys of WARM_UNSAFE_PREFIXES on which `env` differs from `base` (the warm process's)."""
    keys = set(env) | set(base)
    made = () if base.get(MADE_IN_CHILD) else (MADE_IN_CHILD,)  # this process's own entries are not told apart
    return sorted(key for key in keys if key.startswith(WARM_UNSAFE_PREFIXES) and key not in WARM_SAFE + made
                  and env.get(key) != base.get(key))


def preload(with_torch: bool = False) -> None:
    """Import MindSpore and every module of src/ but PyTorch's side (nothing of them runs), then stop
    OpenBLAS's threads. `with_torch`: PyTorch's side too, after MindSpore, as a run that needs it
    imports it, and the dynamo compiler its optimizers import at their first construction."""
    sys.path.insert(0, str(REPO))
    from src.openmp import set_openmp_environment
    set_openmp_environment()  # as the entry points do before MindSpore loads OpenMP, which reads it once
    import mindspore  # noqa: F401
    import mindspore.dataset  # noqa: F401
    import mindspore.train  # noqa: F401

    import src
    for module in pkgutil.walk_packages(src.__path__, "src."):
        if with_torch or not module.name.startswith(SKIPPED):
            importlib.import_module(module.name)
    if with_torch:
        import torch._dynamo  # noqa: F401
    sys.path.remove(str(REPO))
    REPO_MODULES.update(name for name in list(sys.modules) if "." not in name and _entry(name) == str(REPO))
    stop_openblas_threads()


def stop_openblas_threads() -> None:
    """Stop the thread pool of every OpenBLAS loaded (numpy's starts one thread per core but one as it
    loads), as each one's fork handler (pthread_atfork: blas_thread_shutdown_) does before a fork; a
    pool starts again at its first threaded call."""
    with open("/proc/self/maps", encoding="utf-8") as maps:
        paths = {fields[-1] for fields in map(str.split, maps) if len(fields) > 5 and "openblas" in fields[-1]}
    for path in sorted(paths):
        shutdown = getattr(ctypes.CDLL(path), "blas_thread_shutdown_", None)
        if shutdown is not None:
            shutdown()


def threads() -> list:
    """This process's threads, by name."""
    tasks = sorted(os.listdir("/proc/self/task"))
    return [Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in tasks]


def printed_by(function) -> str:
    """Run `function` with file descriptors 1 and 2 captured (C's stdio flushed too): what it printed."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    sink = os.memfd_create("preload-output")
    os.dup2(sink, 1)
    os.dup2(sink, 2)
    try:
        function()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        libc.fflush(None)
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
    os.lseek(sink, 0, os.SEEK_SET)
    text = b"".join(iter(lambda: os.read(sink, 65536), b"")).decode(errors="replace")
    os.close(sink)
    return text


def _entry(name: str) -> str:
    """The sys.path entry the top-level module `name` was found on ("" when not a file's)."""
    spec = getattr(sys.modules.get(name), "__spec__", None)
    origin = getattr(spec, "origin", None)
    if not origin or not os.path.isabs(origin):
        return ""
    folder = os.path.dirname(origin)
    return os.path.dirname(folder) if spec.submodule_search_locations is not None else folder


def first_path_entry(argv: list, cwd: str) -> str:
    """sys.path[0] of a fresh `python ARGV...` run in `cwd` (Python 3.11, no -P or PYTHONSAFEPATH)."""
    if argv[1] == "-c":
        return ""
    if argv[1] == "-m":
        return cwd
    return os.path.dirname(os.path.realpath(os.path.join(cwd, argv[1])))


def python_path(env: dict, cwd: str) -> list:
    """The sys.path entries a fresh interpreter in `cwd` takes from env's PYTHONPATH (absolute; an
    empty entry is the working directory)."""
    listed = env.get(MADE_IN_CHILD)
    return [os.path.normpath(os.path.join(cwd, entry)) for entry in listed.split(os.pathsep)] if listed else []


def stale_modules(argv: list, cwd: str, env: dict) -> tuple:
    """The preloaded top-level modules a fresh run in `cwd` with `env` would not import from the same
    file: the repository's (to drop from sys.modules) and the libraries' (shadowed by the run's first
    sys.path entry or its PYTHONPATH: the run must be fresh), and the startup modules its PYTHONPATH
    holds (the run must be fresh)."""
    first = first_path_entry(argv, cwd) or cwd
    added = python_path(env, cwd)
    fresh = [first, *added] + [entry or cwd for entry in BASE_PATH]
    provided = set()
    for folder in (first, *added):
        try:
            provided |= {name.split(".")[0] for name in os.listdir(folder)}  # modules, packages, extensions
        except OSError:
            pass
    candidates = REPO_MODULES | {name for name in provided if name in sys.modules and "." not in name}
    repository, shadowed = [], []
    importlib.invalidate_caches()
    for name in sorted(candidates):
        spec = importlib.machinery.PathFinder.find_spec(name, fresh)
        if spec is not None and spec.origin == getattr(sys.modules[name].__spec__, "origin", None):
            continue
        (repository if name in REPO_MODULES else shadowed).append(name)
    startup = [name for name in STARTUP_MODULES
               if any(importlib.machinery.PathFinder.find_spec(name, [folder]) for folder in added)]
    return repository, shadowed + startup


def refusal(request: dict, shadowed: list) -> str:
    """Why `request` may not be forked from this process ("" when it may)."""
    running = threads()
    if len(running) != 1:
        return f"the warm process has {len(running)} threads ({', '.join(running)}); a fork keeps only one"
    if shadowed:
        return (f"the run's first sys.path entry or PYTHONPATH has its own {', '.join(shadowed)} (preloaded from "
                f"elsewhere, or run as a fresh interpreter starts)")
    return ""


def skip_preloaded_exit_handlers() -> None:
    """Make exit() end the process once it has run the C exit handlers registered from now on.

    exit() runs its handlers newest first, then flushes C stdio: the two registered here run after
    every later one (the run's) and before every earlier one (the preloaded libraries'): fflush(NULL)
    as exit() would flush, then _exit with exit()'s status (on_exit passes it)."""
    libc = ctypes.CDLL(None)
    libc.on_exit(ctypes.cast(libc._exit, ctypes.c_void_p), None)
    libc.__cxa_atexit(ctypes.cast(libc.fflush, ctypes.c_void_p), None, None)


def run_child(request: dict, stale: list) -> int:
    """In the forked child: become `python ARGV...` and run it; its exit status (SystemExit and an
    uncaught KeyboardInterrupt go on to the interpreter, which ends as a fresh one would)."""
    skip_preloaded_exit_handlers()
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        opened = os.open(path, os.O_WRONLY)
        os.dup2(opened, fd)
        os.close(opened)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if request.get("new_session"):
        os.setsid()  # as subprocess.Popen(start_new_session=True) does in its child
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    import random

    import numpy as np
    random.seed()  # (random reseeds itself after a fork too)
    np.random.seed()  # a fresh process's global generators are seeded from the OS, not the warm one's
    warnings.onceregistry.clear()
    warnings._filters_mutated()  # every module's __warningregistry__ is then out of date, and emptied at its next use
    for name in [name for name in sys.modules if name.split(".")[0] in stale]:
        del sys.modules[name]
    importlib.invalidate_caches()
    main = types.ModuleType("__main__")
    main.__builtins__, main.__annotations__ = builtins, {}
    sys.modules["__main__"] = main
    sys.orig_argv = list(request["argv"])
    base_path = [*python_path(request["env"], os.getcwd()), *BASE_PATH]
    argv = request["argv"][1:]
    try:
        if argv[0] == "-c":
            sys.argv, sys.path = ["-c", *argv[2:]], ["", *base_path]
            main.__loader__ = importlib.machinery.BuiltinImporter
            exec(compile(argv[1], "<string>", "exec", dont_inherit=True), vars(main))
        elif argv[0] == "-m":
            sys.argv, sys.path = ["-m", *argv[2:]], [os.getcwd(), *base_path]
            for name in (argv[1], argv[1] + ".__main__"):
                sys.modules.pop(name, None)  # preloaded: runs afresh as __main__, as `python -m` would
            runpy._run_module_as_main(argv[1])  # what `python -m` calls
        else:
            path = os.path.abspath(argv[0])  # __file__ and the code's file name absolute, as Python's
            sys.argv, sys.path = list(argv), [first_path_entry(request["argv"], os.getcwd()), *base_path]
            try:
                with open(path, "rb") as script:
                    source = script.read()
            except OSError as error:
                print(f"{request['argv'][0]}: can't open file {path!r}: [Errno {error.errno}] {error.strerror}",
                      file=sys.stderr)
                return 2
            main.__file__, main.__cached__ = path, None
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
            exec(compile(source, path, "exec", dont_inherit=True), vars(main))
        return 0
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        trace = error.__traceback__
        while trace is not None and trace.tb_frame.f_globals is globals():
            trace = trace.tb_next  # the frames of this file
        sys.excepthook(type(error), error.with_traceback(trace), trace)
        if type(error) is KeyboardInterrupt:
            sys.excepthook = lambda *_: None  # printed: the interpreter finalizes, then kills itself with SIGINT
            raise
        return 1


def serve(requests, replies) -> int:
    """Fork a child per request until the requests end; in a child, its exit status (the caller exits)."""
    for line in requests:
        request = json.loads(line)
        stale, shadowed = stale_modules(request["argv"], request["cwd"], request["env"])
        refused = refusal(request, shadowed)
        if refused:
            replies.write(json.dumps({"refused": refused}) + "\n")
            replies.flush()
            continue
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            return run_child(request, stale)
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status, usage = os.wait4(pid, 0)
        replies.write(json.dumps({"status": status, "cpu_s": usage.ru_utime + usage.ru_stime}) + "\n")
        replies.flush()
    return 0


def main() -> int:
    BASE_PATH[:] = sys.path[1:]  # sys.path[0] is this file's folder
    printed = printed_by(functools.partial(preload, with_torch=TORCH_FLAG in sys.argv[3:]))
    # The preloaded heap lives in every child: frozen, no child's collection walks it (a child's exit
    # costs ~0.7 CPU-s less; the entry points' run_cli freezes it too) and its pages stay shared.
    gc.freeze()
    requests = os.fdopen(int(sys.argv[1]), "r", encoding="utf-8")
    replies = os.fdopen(int(sys.argv[2]), "w", encoding="utf-8")
    replies.write(json.dumps({"ready": os.getpid(), "printed": printed}) + "\n")
    replies.flush()
    code = serve(requests, replies)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())  # in a child too: the interpreter ends as the run's would, exit handlers and all
