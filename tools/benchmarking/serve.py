"""A framework's measuring process (benchmark.py --worker NAME): builds its runner, then answers
the orchestrator's commands."""
import argparse
import json
import sys

from tools.benchmarking.breakdown import serve_breakdown, step_taken_apart
from tools.benchmarking.cpu_paths import MINDSPORE_WORKERS, ONNX_WORKERS
from tools.benchmarking.end_to_end import end_to_end_rate, pipeline_rate
from tools.benchmarking.mindspore_runner import mindspore_runner
from tools.benchmarking.onnx_runner import OnnxRunner
from tools.benchmarking.timing import measure_runner
from tools.benchmarking.torch_runner import torch_runner
from tools.benchmarking.worker import reply


def serve(args: argparse.Namespace) -> int:
    """A measuring process for one framework: builds its runner, then answers commands on stdin
    ('measure', 'export FOLDER', 'data ROOT', 'breakdown', 'quit') with one JSON line each. The two
    frameworks never share a process: PyTorch beside an initialized MindSpore ran at half its own
    speed here."""
    if args.worker in MINDSPORE_WORKERS:
        runner = mindspore_runner(args)
    elif args.worker in ONNX_WORKERS:
        runner = OnnxRunner(args.onnx_files.split(","), args.threads,
                            host_normalize=args.worker == "onnxruntime_hostnorm")
    else:
        runner = torch_runner(args)
    if args.breakdown:
        return serve_breakdown(runner, args.breakdown)

    first = {"compile_s": runner.compile_seconds()}
    reply({**first, "model": runner.summary()} if args.worker in MINDSPORE_WORKERS else first)
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "measure":
            reply(measure_runner(runner, args.batch_size, steps=args.steps, repeats=1, calls=args.calls))
        elif command == "export":
            reply({"onnx_files": runner.export_onnx(argument, args.batch_size, args.image_size),
                   "pixel_files": runner.export_onnx(argument, args.batch_size, args.image_size, pixels=True)})
        elif command == "breakdown":
            reply(step_taken_apart(runner))
        elif command == "data":
            paths = json.loads(argument)
            batches = max(4, args.steps)
            reply({"pipeline_img_per_s": {name: pipeline_rate(name, path, args.batch_size, args.image_size,
                                                              args.workers, batches) for name, path in paths.items()},
                   "train_end_to_end_img_per_s": {
                       name: end_to_end_rate(runner, name, path, args.batch_size, args.image_size, args.workers,
                                             args.steps) for name, path in paths.items()}})
        else:
            break
    return 0
