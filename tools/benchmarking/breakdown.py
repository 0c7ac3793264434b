"""One training step taken apart: oneDNN's primitives by kind (oneDNN's verbose execution profile)
and the rest of the step, then that rest op by op (MindSpore's profiler), in the measuring process
of its path once its speeds are measured (or alone: benchmark.py --worker NAME --breakdown onednn|operators)."""
import contextlib
import ctypes
import json
import os
import statistics
import tempfile
import time
from typing import Dict, Iterator, List, Optional

BREAKDOWN_MARK = "BREAKDOWN "
BREAKDOWN_KINDS = {"convolution": "convolutions", "batch_normalization": "normalization", "pooling": "pooling",
                   "reorder": "layout reorders"}


# Operators whose time is oneDNN's (counted by kind above): our layers, and MindSpore's own convolution,
# normalization and pooling kernels.
ONEDNN_OPERATORS = ("Custom:OneDnn", "Custom:BlockedToPlain", "Conv2D", "BatchNorm", "MaxPool")
# Operators named one by one in the rest; the others are summed.
NAMED_OPERATORS = 8
# Steps a fresh process trains before a breakdown: the first compiles, the next settle.
WARM_UP_STEPS = 3
# Steps the oneDNN breakdown times, unprofiled and then as many profiled.
BREAKDOWN_STEPS = 3


def serve_breakdown(runner, kind: str) -> int:
    """A process of one breakdown alone: prints BREAKDOWN_MARK and the JSON of 'onednn'
    (onednn_breakdown) or 'operators' (operator_table)."""
    for _ in range(WARM_UP_STEPS):
        runner.train_step()
    result = onednn_breakdown(runner) if kind == "onednn" else {"operators": operator_table(runner)}
    print(BREAKDOWN_MARK + json.dumps(result), flush=True)
    return 0


def step_taken_apart(runner) -> Dict[str, Dict[str, float]]:
    """The breakdowns of a warm runner's training step: 'kinds' (onednn_breakdown), 'own' (our layers'
    own loops in those steps, part of their rest: own_loops_ms) and 'rest' (the rest op by op,
    rest_by_operator)."""
    runner.train_step()
    before = _own_loop_seconds()
    kinds = onednn_breakdown(runner, BREAKDOWN_STEPS)
    own = own_loops_ms(before, _own_loop_seconds(), 2 * BREAKDOWN_STEPS)
    return {"kinds": kinds, "own": own, "rest": rest_by_operator(operator_table(runner))}


def _own_loop_seconds() -> Dict[str, float]:
    """Our layers' own loop timers (src.cpu_convolution.library.own_loop_seconds), or none where this
    process has not loaded our library (MindSpore's convolutions)."""
    from src.cpu_convolution import library
    return library.own_loop_seconds() if _already_loaded(library.LIBRARY) else {}


def own_loops_ms(before: Dict[str, float], after: Dict[str, float], steps: int) -> Dict[str, float]:
    """Milliseconds per step each of our layers' own loops took between two readings of their timers:
    time inside our kernels outside oneDNN's primitives, which the breakdown counts in the rest."""
    return {name: round((after[name] - before[name]) * 1000 / steps, 1) for name in after}


def operator_table(runner, steps: int = 4) -> Dict[str, float]:
    """`steps` training steps under MindSpore's profiler: each operator type's milliseconds per step
    (src.training.profile_table, our layers by cell)."""
    from mindspore.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    from src.training.profile_table import find_summary, read_summary
    with tempfile.TemporaryDirectory(prefix="benchmark-profile-") as folder:
        profiler = profile(activities=[ProfilerActivity.CPU], on_trace_ready=tensorboard_trace_handler(folder),
                           schedule=schedule(wait=0, warmup=1, active=steps, repeat=1, skip_first=0),
                           start_profile=False)
        profiler.start()
        for _ in range(steps + 1):
            runner.train_step()
            profiler.step()
        profiler.stop()
        rows = read_summary(find_summary(folder), steps)
    return {row.op_type: row.ms_per_step for row in rows}


def rest_by_operator(operators: Dict[str, float]) -> Dict[str, float]:
    """The operators of the rest of a step (those outside the layers that oneDNN runs,
    ONEDNN_OPERATORS), ms per step: the NAMED_OPERATORS costliest by name, the others summed. (The
    time between operators is left out: the profiler slows it several-fold and its operators' own
    times by a little, so neither the profiled nor an unprofiled step gives it reliably.)"""
    others = sorted(((ms, name) for name, ms in operators.items() if not name.startswith(ONEDNN_OPERATORS)),
                    reverse=True)
    rest = {name: round(ms, 1) for ms, name in others[:NAMED_OPERATORS]}
    rest["other operators"] = round(sum(ms for ms, _ in others[NAMED_OPERATORS:]), 1)
    return rest


def _onednn_libraries() -> List[ctypes.CDLL]:
    """The oneDNN copies this process has loaded: MindSpore's, and our layers' (src/cpu_convolution)."""
    import mindspore

    from src.cpu_convolution.library import NATIVE_DIR
    paths = (os.path.join(os.path.dirname(mindspore.__file__), "lib", "libdnnl.so.3"),
             os.path.join(NATIVE_DIR, "libdnnl_resnet.so.3"))
    return [library for library in map(_already_loaded, paths) if library]


def _already_loaded(path: str) -> Optional[ctypes.CDLL]:
    """The shared library at `path` if this process has loaded it (our layers are not in every path)."""
    try:
        return ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
    except OSError:
        return None


@contextlib.contextmanager
def _onednn_verbose() -> Iterator[List[str]]:
    """oneDNN's execution profile (dnnl_set_verbose(1), ONEDNN_VERBOSE=profile_exec's lines) of what
    runs inside: its lines, which oneDNN prints to this process's stdout, go to a file instead
    (stdout is the orchestrator's pipe) and into the list yielded once the block ends."""
    libraries, libc = _onednn_libraries(), ctypes.CDLL(None)
    lines: List[str] = []
    with tempfile.TemporaryFile(mode="w+") as captured:
        libc.fflush(None)
        saved = os.dup(1)
        os.dup2(captured.fileno(), 1)
        try:
            for library in libraries:
                library.dnnl_set_verbose(1)
            yield lines
        finally:
            for library in libraries:
                library.dnnl_set_verbose(0)
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        captured.seek(0)
        lines.extend(captured.read().splitlines())


def onednn_breakdown(runner, steps: int = BREAKDOWN_STEPS) -> Dict[str, float]:
    """Milliseconds per step by operation kind over `steps` training steps of a warm runner: oneDNN's
    primitives by kind (MindSpore's copy and ours both), and the rest of the step (MindSpore's own
    kernels, the optimizer, the framework). The step is the median of as many unprofiled steps timed
    first: oneDNN's verbose profile formats and writes a line per primitive (ResNet18 at 32 px: 18 of
    a 107 ms step), which is the profile's cost, not the step's; 'profiled_step_ms' keeps it."""
    unprofiled = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.train_step()
        unprofiled.append(time.perf_counter() - start)
    with _onednn_verbose() as lines:
        start = time.perf_counter()
        for _ in range(steps):
            runner.train_step()
        profiled = time.perf_counter() - start
    totals: Dict[str, float] = {}
    for line in lines:
        fields = line.split(",")
        if not line.startswith("onednn_verbose") or "exec" not in fields:
            continue
        kind = fields[fields.index("exec") + 2]
        try:
            milliseconds = float(fields[-1])
        except ValueError:
            continue
        name = BREAKDOWN_KINDS.get(kind, "other oneDNN")
        totals[name] = totals.get(name, 0.0) + milliseconds / steps
    step_ms = statistics.median(unprofiled) * 1000
    totals["the rest"] = step_ms - sum(totals.values())
    return {"step_ms": round(step_ms, 1), **{name: round(value, 1) for name, value in totals.items()},
            "profiled_step_ms": round(profiled / steps * 1000, 1)}
