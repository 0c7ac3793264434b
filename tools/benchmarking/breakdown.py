"""One training step taken apart: oneDNN's primitives by kind (ONEDNN_VERBOSE=profile_exec) and the
rest of the step, then that rest op by op (MindSpore's profiler), each from a measuring process of its
own (benchmark.py --worker NAME --breakdown onednn|operators)."""
import argparse
import json
import os
import subprocess
import tempfile
import time
from typing import Dict, List

from tools.benchmarking.worker import REPO, entry_command

BREAKDOWN_MARK = "BREAKDOWN "
BREAKDOWN_KINDS = {"convolution": "convolutions", "batch_normalization": "normalization", "pooling": "pooling",
                   "reorder": "layout reorders"}


# Operators whose time is oneDNN's (counted by kind above): our layers, and MindSpore's own convolution,
# normalization and pooling kernels.
ONEDNN_OPERATORS = ("Custom:OneDnn", "Custom:BlockedToPlain", "Conv2D", "BatchNorm", "MaxPool")
# Operators named one by one in the rest; the others are summed.
NAMED_OPERATORS = 8


def serve_breakdown(runner, kind: str) -> int:
    """The measuring process of one breakdown: 'onednn' (serve_onednn_breakdown) or 'operators'
    (serve_operator_table)."""
    return serve_onednn_breakdown(runner) if kind == "onednn" else serve_operator_table(runner)


def serve_operator_table(runner, steps: int = 4) -> int:
    """Warm-up training steps, then `steps` under MindSpore's profiler; prints each operator type's
    milliseconds per step (src.training.profile_table, our layers by cell)."""
    from mindspore.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    from src.training.profile_table import find_summary, read_summary
    for _ in range(3):
        runner.train_step()
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
    print(BREAKDOWN_MARK + json.dumps({"operators": {row.op_type: row.ms_per_step for row in rows}}), flush=True)
    return 0


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


def serve_onednn_breakdown(runner, steps: int = 2) -> int:
    """Warm-up training steps, then `steps` more between two marks on stdout, the second with their
    seconds: run with ONEDNN_VERBOSE=profile_exec, the lines between are every oneDNN primitive
    those steps executed, with its milliseconds."""
    for _ in range(3):
        runner.train_step()
    print(BREAKDOWN_MARK + "start", flush=True)
    start = time.perf_counter()
    for _ in range(steps):
        runner.train_step()
    print(BREAKDOWN_MARK + json.dumps({"seconds_per_step": (time.perf_counter() - start) / steps, "steps": steps}),
          flush=True)
    return 0


def step_breakdown(text: str) -> Dict[str, float]:
    """Milliseconds per step by operation kind from a breakdown worker's output: oneDNN's primitives
    (MindSpore's copy and ours both print profile_exec lines), and the rest of the step (MindSpore's
    own kernels, the optimizer, the framework)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line == BREAKDOWN_MARK + "start")
    end = next(i for i, line in enumerate(lines) if i > start and line.startswith(BREAKDOWN_MARK))
    result = json.loads(lines[end][len(BREAKDOWN_MARK):])
    totals: Dict[str, float] = {}
    for line in lines[start + 1:end]:
        fields = line.split(",")
        if not line.startswith("onednn_verbose") or "exec" not in fields:
            continue
        kind = fields[fields.index("exec") + 2]
        try:
            milliseconds = float(fields[-1])
        except ValueError:
            continue
        name = BREAKDOWN_KINDS.get(kind, "other oneDNN")
        totals[name] = totals.get(name, 0.0) + milliseconds / result["steps"]
    step_ms = result["seconds_per_step"] * 1000
    totals["the rest"] = step_ms - sum(totals.values())
    return {"step_ms": round(step_ms, 1), **{name: round(value, 1) for name, value in totals.items()}}


def _breakdown_output(kind: str, worker: str, net_name: str, batch: int, size: int,
                      args: argparse.Namespace) -> str:
    """What a breakdown process of `kind` printed."""
    command = entry_command("--worker", worker, "--breakdown", kind, "--net", net_name,
                            "--batch_size", str(batch), "--image_size", str(size), "--threads", str(args.threads),
                            "--cpu_isa", args.cpu_isa)
    env = dict(os.environ, ONEDNN_VERBOSE="profile_exec") if kind == "onednn" else None
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if result.returncode != 0:
        raise RuntimeError(f"the {worker} {kind} breakdown process failed (exit {result.returncode}): "
                           f"{result.stderr.strip().splitlines()[-1:]}")
    return result.stdout


def measure_breakdown(worker: str, net_name: str, batch: int, size: int,
                      args: argparse.Namespace) -> List[Dict[str, float]]:
    """One training step of `worker` taken apart by operation kind (step_breakdown), and its rest op by
    op (rest_by_operator), each in a process of its own."""
    kinds = step_breakdown(_breakdown_output("onednn", worker, net_name, batch, size, args))
    table = _operator_table(_breakdown_output("operators", worker, net_name, batch, size, args))
    return [kinds, rest_by_operator(table["operators"])]


def _operator_table(text: str) -> Dict:
    line = next(line for line in text.splitlines() if line.startswith(BREAKDOWN_MARK))
    return json.loads(line[len(BREAKDOWN_MARK):])
