"""Measure training, evaluation and data-pipeline speed, optionally side by side with PyTorch.

    python benchmark.py --preset targets --vs-torch --json output/benchmark.json
    python benchmark.py --net resnet50 --batch_size 8 --image_size 224 --vs-torch

For each (net, batch, image size) it reports, after warm-up and as medians over --repeats runs:
graph compile time; training img/s on in-memory data (compute) and through the real pipeline
from generated CIFAR-10 binary files and JPEG class folders (end to end); evaluation img/s and
latency p50/p95/p99 at batch 1 and at the batch size; and each pipeline's img/s alone. With
--vs-torch the same network, batch, size and thread count run in PyTorch eager fp32, in a
process of their own, alternating with MindSpore, and the ratios are printed. Everything is fp32 on the CPU.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from src.errors import OneLineParser, UserInputError, run_cli

PRESETS = {"targets": [("resnet50", 8, 224), ("resnet18", 64, 32)]}
CLASSES = 10


def percentiles_ms(seconds: Sequence[float]) -> Dict[str, float]:
    values = np.asarray(seconds) * 1000.0
    return {f"p{q}": round(float(np.percentile(values, q)), 3) for q in (50, 95, 99)}


def median_rate(fn: Callable[[], None], images: int, *, steps: int, repeats: int) -> float:
    """Median over `repeats` runs of `steps` calls of images/second."""
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        rates.append(images * steps / (time.perf_counter() - start))
    return round(float(np.median(rates)), 2)


def latency(fn: Callable[[], None], images: int, calls: int) -> Dict[str, float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"img_per_s": round(images / float(np.median(times)), 2), "latency_ms": percentiles_ms(times)}


class MindSporeRunner:
    """Train and eval steps of this repository's network, optimizer and loss in GRAPH mode."""

    name = "mindspore"

    def __init__(self, net_name: str, batch: int, size: int):
        import mindspore as ms
        from mindspore import nn

        from src.loss import create_loss
        from src.optimizer import create_optimizer
        from src.resnet import create_model
        self.net = create_model(net_name, num_classes=CLASSES)
        optimizer = create_optimizer(self.net, name="Momentum", learning_rate=0.01, weight_decay=1e-4)
        self.train_cell = nn.TrainOneStepCell(nn.WithLossCell(self.net, create_loss(num_classes=CLASSES)), optimizer)
        self.training = None
        rng = np.random.default_rng(0)
        self.images = ms.Tensor(rng.random((batch, 3, size, size), dtype=np.float32))
        self.labels = ms.Tensor((np.arange(batch) % CLASSES).astype(np.int32))
        self.one = ms.Tensor(rng.random((1, 3, size, size), dtype=np.float32))

    def compile_seconds(self) -> float:
        start = time.perf_counter()
        self.train_step()
        first = time.perf_counter() - start
        start = time.perf_counter()
        self.train_step()
        return round(first - (time.perf_counter() - start), 2)

    def _set_training(self, training: bool) -> None:
        # One network serves both graphs: switch BatchNorm's mode only when the phase changes.
        if self.training != training:
            self.train_cell.set_train(training)
            self.training = training

    def train_step(self, images=None, labels=None) -> None:
        self._set_training(True)
        loss = self.train_cell(self.images if images is None else images, self.labels if labels is None else labels)
        loss.asnumpy()

    def eval_step(self, single: bool) -> None:
        self._set_training(False)
        self.net(self.one if single else self.images).asnumpy()


class TorchRunner:
    """The same ResNet, SGD with momentum and cross-entropy in PyTorch eager fp32."""

    name = "torch"

    def __init__(self, net_name: str, batch: int, size: int, threads: int):
        import torch

        from src import torch_resnet
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        self.torch = torch
        self.net = getattr(torch_resnet, net_name)(num_classes=CLASSES)
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
        self.loss = torch.nn.CrossEntropyLoss()
        self.images = torch.rand(batch, 3, size, size)
        self.labels = torch.arange(batch) % CLASSES
        self.one = torch.rand(1, 3, size, size)

    def compile_seconds(self) -> float:
        self.train_step()
        return 0.0  # eager: nothing to compile

    def train_step(self) -> None:
        self.net.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.loss(self.net(self.images), self.labels).backward()
        self.optimizer.step()

    def eval_step(self, single: bool) -> None:
        self.net.eval()
        with self.torch.no_grad():
            self.net(self.one if single else self.images)


def measure_runner(runner, batch: int, *, steps: int, repeats: int, calls: int) -> Dict:
    result = {"train_compute_img_per_s": median_rate(runner.train_step, batch, steps=steps, repeats=repeats)}
    for label, single in (("eval_batch_1", True), (f"eval_batch_{batch}", False)):
        runner.eval_step(single)  # warm-up (compiles the inference graph once)
        result[label] = latency(lambda: runner.eval_step(single), 1 if single else batch, calls)
    return result


def write_data(root: str, size: int, images: int) -> Dict[str, str]:
    """Generated CIFAR-10 binary files and JPEG class folders (images a bit larger than `size`),
    at least `images` of each: the timed loops never reach the end of an epoch."""
    from src.sample_data import write_sample_data
    per_class = -(-images // CLASSES)
    write_sample_data(root, train_per_class=per_class, test_per_class=1, formats=("cifar10",))
    write_sample_data(os.path.join(root, "folders"), train_per_class=per_class, test_per_class=1,
                      formats=("imagenet",), folder_size=max(64, int(size * 1.15)))
    return {"cifar10": os.path.join(root, "cifar10"), "imagenet2012": os.path.join(root, "folders", "imagenet")}


def pipeline_rate(dataset: str, path: str, batch: int, size: int, workers: int, batches: int) -> float:
    """Training-pipeline img/s alone (decode, augmentation, normalization, batching)."""
    from src.dataset import create_dataset
    data = create_dataset(dataset, path, training=True, batch_size=batch, image_size=size,
                          num_parallel_workers=workers)
    iterator = data.create_tuple_iterator(num_epochs=-1, output_numpy=True)
    next(iterator)  # start-up
    start, images = time.perf_counter(), 0
    for _ in range(batches):
        images += len(next(iterator)[1])
    return round(images / (time.perf_counter() - start), 2)


def end_to_end_rate(runner: MindSporeRunner, dataset: str, path: str, batch: int, size: int, workers: int,
                    steps: int) -> float:
    """Training img/s with batches coming from the real pipeline."""
    from src.dataset import create_dataset
    data = create_dataset(dataset, path, training=True, batch_size=batch, image_size=size,
                          num_parallel_workers=workers)
    iterator = data.create_tuple_iterator(num_epochs=-1)
    runner.train_step(*next(iterator))
    start = time.perf_counter()
    for _ in range(steps):
        runner.train_step(*next(iterator))
    return round(batch * steps / (time.perf_counter() - start), 2)


REPLY = "BENCHMARK-REPLY "


def serve(args: argparse.Namespace) -> int:
    """A measuring process for one framework: builds its runner, then answers commands on stdin
    ('measure', 'data ROOT', 'quit') with one JSON line each. The two frameworks never share a
    process: PyTorch beside an initialized MindSpore ran at half its own speed here."""
    if args.worker == "mindspore":
        from src.device import init_device
        init_device("CPU", mode_name="GRAPH", cpu_threads=args.threads)
        runner = MindSporeRunner(args.net, args.batch_size, args.image_size)
    else:
        runner = TorchRunner(args.net, args.batch_size, args.image_size, args.threads)

    def reply(value) -> None:
        print(REPLY + json.dumps(value), flush=True)

    reply({"compile_s": runner.compile_seconds()})
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "measure":
            reply(measure_runner(runner, args.batch_size, steps=args.steps, repeats=1, calls=args.calls))
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


class Worker:
    """The orchestrator's handle on a measuring process."""

    def __init__(self, framework: str, net_name: str, batch: int, size: int, args: argparse.Namespace):
        command = [sys.executable, os.path.abspath(__file__), "--worker", framework, "--net", net_name,
                   "--batch_size", str(batch), "--image_size", str(size), "--threads", str(args.threads),
                   "--workers", str(args.workers), "--steps", str(args.steps), "--calls", str(args.calls)]
        self.framework = framework
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        cwd=os.path.dirname(os.path.abspath(__file__)))
        self.first = self._read()

    def _read(self) -> Dict:
        for line in self.process.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        raise RuntimeError(f"the {self.framework} benchmark process ended early (exit {self.process.wait()})")

    def ask(self, command: str) -> Dict:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            if self.process.poll() is None:
                self.process.stdin.write("quit\n")
            self.process.stdin.close()
        except BrokenPipeError:  # it ended on its own; its exit code is what matters
            pass
        self.process.wait()


def benchmark(net_name: str, batch: int, size: int, args: argparse.Namespace, data_root: str) -> Dict:
    """All measurements for one configuration; MindSpore and PyTorch alternate repeat by repeat,
    each in its own process."""
    report = {"net": net_name, "batch_size": batch, "image_size": size, "threads": args.threads,
              "workers": args.workers}
    workers = []
    try:
        for framework in ("mindspore", "torch") if args.vs_torch else ("mindspore",):
            workers.append(Worker(framework, net_name, batch, size, args))
        rounds: Dict[str, List[Dict]] = {worker.framework: [] for worker in workers}
        for _ in range(args.repeats):
            for worker in workers:
                rounds[worker.framework].append(worker.ask("measure"))
        for worker in workers:
            report[worker.framework] = {**worker.first, **_median_of(rounds[worker.framework])}
        paths = write_data(os.path.join(data_root, f"{net_name}_{size}"), size,
                           images=(max(4, args.steps) + 2) * batch)
        data = workers[0].ask("data " + json.dumps(paths))
    finally:
        for worker in workers:
            worker.close()
    report["pipeline_img_per_s"] = data["pipeline_img_per_s"]
    report["mindspore"]["train_end_to_end_img_per_s"] = data["train_end_to_end_img_per_s"]
    report["ratios"] = _ratios(report)
    return report


def _median_of(results: List[Dict]) -> Dict:
    """Element-wise median of nested measurement dicts."""
    first = results[0]
    if isinstance(first, dict):
        return {key: _median_of([r[key] for r in results]) for key in first}
    return round(float(np.median(results)), 3)


def _ratios(report: Dict) -> Dict[str, float]:
    ms_result = report["mindspore"]
    consumed = ms_result["train_compute_img_per_s"]
    ratios = {f"pipeline_{name}_over_training": round(rate / consumed, 2)
              for name, rate in report["pipeline_img_per_s"].items()}
    if "torch" in report:
        torch_result = report["torch"]
        ratios["train_mindspore_over_torch"] = round(consumed / torch_result["train_compute_img_per_s"], 3)
        for label in ms_result:
            if label.startswith("eval_batch_"):
                ratios[f"{label}_mindspore_over_torch"] = round(
                    ms_result[label]["img_per_s"] / torch_result[label]["img_per_s"], 3)
    return ratios


def format_table(reports: List[Dict]) -> str:
    lines = []
    for r in reports:
        ms_result, torch_result = r["mindspore"], r.get("torch")
        lines.append(f"{r['net']} batch {r['batch_size']} @ {r['image_size']}px, {r['threads']} threads, "
                     f"{r['workers']} pipeline workers")
        lines.append(f"  {'measure':<38}{'MindSpore':>22}{'PyTorch':>22}{'ratio':>8}")

        def row(label: str, ms_value, torch_value=None, ratio=None):
            torch_text = "" if torch_value is None else torch_value
            ratio_text = "" if ratio is None else ratio
            lines.append(f"  {label:<38}{ms_value:>22}{torch_text:>22}{ratio_text:>8}")

        row("graph compile (s)", ms_result["compile_s"])
        row("train img/s (compute)", ms_result["train_compute_img_per_s"],
            torch_result and torch_result["train_compute_img_per_s"], r["ratios"].get("train_mindspore_over_torch"))
        for name, value in ms_result["train_end_to_end_img_per_s"].items():
            row(f"train img/s (end to end, {name})", value)
        for label in [k for k in ms_result if k.startswith("eval_batch_")]:
            ms_eval, torch_eval = ms_result[label], torch_result and torch_result[label]
            row(f"{label.replace('_', ' ')} img/s", ms_eval["img_per_s"], torch_eval and torch_eval["img_per_s"],
                r["ratios"].get(f"{label}_mindspore_over_torch"))
            row(f"{label.replace('_', ' ')} p50/p95/p99 ms",
                "/".join(f"{v:.1f}" for v in ms_eval["latency_ms"].values()),
                torch_eval and "/".join(f"{v:.1f}" for v in torch_eval["latency_ms"].values()))
        for name, value in r["pipeline_img_per_s"].items():
            row(f"pipeline img/s ({name})", value, None, r["ratios"][f"pipeline_{name}_over_training"])
        lines.append("  ratio: MindSpore / PyTorch; for the pipeline rows, pipeline img/s / MindSpore training img/s")
        lines.append("")
    return "\n".join(lines)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


positive_int.__name__ = "positive integer"  # argparse names the type in its error line


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = OneLineParser(prog="benchmark.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), help="run the preset configurations")
    parser.add_argument("--net", default="resnet50", help="resnet18, resnet34, resnet50, resnet101 or resnet152")
    parser.add_argument("--batch_size", type=positive_int, default=8)
    parser.add_argument("--image_size", type=positive_int, default=224)
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="compute threads, both frameworks (default: one per available core)")
    parser.add_argument("--workers", type=positive_int, default=1, help="data pipeline workers (best on 2 cores: 1)")
    parser.add_argument("--steps", type=positive_int, default=5, help="steps per timed run")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs; medians are reported")
    parser.add_argument("--calls", type=positive_int, default=20, help="timed calls per latency measurement")
    parser.add_argument("--vs-torch", dest="vs_torch", action="store_true", help="also run PyTorch eager")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--worker", choices=("mindspore", "torch"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker:  # the measuring processes get checked values; the torch one must not load MindSpore
        from src.device import available_cores, cap_workers
        from src.resnet import ARCHS
        if args.net not in ARCHS:
            parser.error(f"argument --net: invalid choice: '{args.net}' (choose from {', '.join(ARCHS)})")
        args.threads = args.threads or available_cores()
        args.workers, note = cap_workers(args.workers)
        if note:
            print(note.replace("num_parallel_workers", "--workers"), flush=True)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return serve(args)
    if args.vs_torch and importlib.util.find_spec("torch") is None:
        from src.convert_torch import INSTALL_HINT
        raise UserInputError(f"--vs-torch needs PyTorch, which is not installed; {INSTALL_HINT}")
    configs = PRESETS[args.preset] if args.preset else [(args.net, args.batch_size, args.image_size)]
    reports = []
    with tempfile.TemporaryDirectory(prefix="benchmark-") as data_root:
        for net_name, batch, size in configs:
            reports.append(benchmark(net_name, batch, size, args, data_root))
    print(format_table(reports))
    if args.json:
        from src.config import write_atomic
        write_atomic(args.json, json.dumps({"reports": reports}, indent=2) + "\n")
        print(f"report written to {args.json}")
    return 0


if __name__ == "__main__":
    run_cli(main)
