"""One training step taken apart: oneDNN's primitives by kind (ONEDNN_VERBOSE=profile_exec) and the
rest of the step, from a measuring process of its own (benchmark.py --worker NAME --breakdown)."""
import argparse
import json
import os
import subprocess
import time
from typing import Dict

from tools.benchmarking.worker import REPO, entry_command

BREAKDOWN_MARK = "BREAKDOWN "
BREAKDOWN_KINDS = {"convolution": "convolutions", "batch_normalization": "normalization", "pooling": "pooling",
                   "reorder": "layout reorders"}


def serve_breakdown(runner, steps: int = 2) -> int:
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


def measure_breakdown(worker: str, net_name: str, batch: int, size: int, args: argparse.Namespace) -> Dict[str, float]:
    """One training step of `worker` taken apart by operation kind (step_breakdown), in a process of its own."""
    command = entry_command("--worker", worker, "--breakdown", "--net", net_name,
                            "--batch_size", str(batch), "--image_size", str(size), "--threads", str(args.threads),
                            "--cpu_isa", args.cpu_isa)
    env = dict(os.environ, ONEDNN_VERBOSE="profile_exec")
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if result.returncode != 0:
        raise RuntimeError(f"the {worker} breakdown process failed (exit {result.returncode}): "
                           f"{result.stderr.strip().splitlines()[-1:]}")
    return step_breakdown(result.stdout)
