"""Measure training, evaluation and data-pipeline speed, optionally side by side with PyTorch.

    python benchmark.py --preset targets --vs-torch --json output/benchmark.json
    python benchmark.py --net resnet50 --batch_size 8 --image_size 224 --vs-torch

For each (net, batch, image size) it reports, after warm-up and as medians over --repeats runs:
graph compile time; training img/s on in-memory data (compute) and through the real pipeline
from generated CIFAR-10 binary files and JPEG class folders (end to end); evaluation img/s and
latency p50/p95/p99 at batch 1 and at the batch size; and each pipeline's img/s alone. With
--vs-torch the same network, batch, size and thread count run in PyTorch eager fp32, in a
process of their own, alternating with MindSpore, and the ratios are printed. With onnxruntime
installed, the network exported to ONNX (batch 1 and batch N) is evaluated under onnxruntime too:
the float file alone, the float file after host normalization of a uint8 batch (what its deployment
runs), and the file exported with the input stage (export.py --export_input_stage True, uint8
pixels in); with onnx installed as well, the float files quantized to int8 (export.py --quantize's code).
Then the ImageNet input pipelines: --photos photograph-like JPEGs (ImageNet sizes, quality 90) are
generated, their mean size and PIL decode time reported, and this repository's pipeline and
MindSpore's native one (as the model zoo builds it) measured on them, train and eval, one worker
pinned to one core, then 1 and 2 workers on 2 cores. Everything is fp32 on the CPU.
Each configuration also lists the model's parameters, GFLOPs per image at its size (torchvision's
convention: multiply-accumulates) and the GFLOP/s its training and evaluation achieved.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from src.errors import OneLineParser, UserInputError, run_cli

PRESETS = {"targets": [("resnet50", 8, 224), ("resnet18", 64, 32)]}
CLASSES = 10
ONNX_WORKERS = ("onnxruntime", "onnxruntime_hostnorm", "onnxruntime_pixels", "onnxruntime_int8")


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
        from src.resnet import create_model
        from src.training.optimizer import create_optimizer
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

    def summary(self) -> Dict:
        """Parameters, GFLOPs per image at the measured size, and the weights' size."""
        from src.training.model_summary import model_summary
        return model_summary(self.net, image_size=int(self.one.shape[-1]))

    def export_onnx(self, folder: str, batch: int, size: int, pixels: bool = False) -> List[str]:
        """The network in inference mode as ONNX files for batch 1 and `batch` (ONNX batches are
        fixed); `pixels`: with the input stage in front (uint8 NHWC in)."""
        from export import export_network
        from src.data.input_stage import WithInputStage, normalization_of
        self._set_training(False)
        net = WithInputStage(self.net, normalization_of("imagenet2012")) if pixels else self.net
        net.set_train(False)
        return [export_network(net, file_name=f"{self.name}{'_pixels' if pixels else ''}_b{n}", file_format="ONNX",
                               batch_size=n, height=size, width=size, staging=folder, pixels=pixels)
                for n in (1, batch)]


class TorchRunner:
    """The same ResNet, SGD with momentum and cross-entropy in PyTorch eager fp32."""

    name = "torch"

    def __init__(self, net_name: str, batch: int, size: int, threads: int):
        import torch

        from src.migration import torch_resnet
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


class OnnxRunner:
    """The MindSpore network exported to ONNX (batch 1 and batch N files: float, int8, or uint8
    pixels in), run by onnxruntime with the session predict.py uses; inference only. With
    `host_normalize` a float file's every call first normalizes a uint8 NHWC batch on the host."""

    trains = False

    def __init__(self, files: Sequence[str], threads: int, host_normalize: bool = False):
        from src.deploy.inference import onnx_session
        start = time.perf_counter()
        self.sessions = [onnx_session(path, threads) for path in files]  # batch 1, then batch N
        self.build_s = time.perf_counter() - start
        self.host_normalize = host_normalize
        rng = np.random.default_rng(0)
        self.inputs = []
        for session in self.sessions:
            model_input = session.get_inputs()[0]
            if model_input.type == "tensor(uint8)" or host_normalize:  # pixels, NHWC
                n, *rest = model_input.shape
                shape = (n, *rest) if model_input.type == "tensor(uint8)" else (n, rest[1], rest[2], 3)
                self.inputs.append({model_input.name: rng.integers(0, 256, shape, dtype=np.uint8)})
            else:
                self.inputs.append({model_input.name: rng.random(model_input.shape, dtype=np.float32)})

    def compile_seconds(self) -> float:
        return round(self.build_s, 2)  # session creation: graph optimization and kernel selection

    def eval_step(self, single: bool) -> None:
        index = 0 if single else 1
        feed = self.inputs[index]
        if self.host_normalize:
            feed = {name: host_normalize_pixels(pixels) for name, pixels in feed.items()}
        self.sessions[index].run(None, feed)


def host_normalize_pixels(pixels: np.ndarray) -> np.ndarray:
    """src/data/input_stage.host_normalize's arithmetic (uint8 NHWC -> float32 NCHW, ImageNet's
    statistics), written out so the onnxruntime process never loads MindSpore (that module imports it)."""
    shift = np.array([0.485, 0.456, 0.406], np.float32) * 255
    scale = 1 / (255 * np.array([0.229, 0.224, 0.225], np.float32))
    return np.ascontiguousarray(((pixels.astype(np.float32) - shift) * scale).transpose(0, 3, 1, 2))


def measure_runner(runner, batch: int, *, steps: int, repeats: int, calls: int) -> Dict:
    result = {}
    if getattr(runner, "trains", True):
        result["train_compute_img_per_s"] = median_rate(runner.train_step, batch, steps=steps, repeats=repeats)
    for label, single in (("eval_batch_1", True), (f"eval_batch_{batch}", False)):
        runner.eval_step(single)  # warm-up (compiles the inference graph once)
        result[label] = latency(lambda: runner.eval_step(single), 1 if single else batch, calls)
    return result


def write_data(root: str, size: int, images: int) -> Dict[str, str]:
    """Generated CIFAR-10 binary files and JPEG class folders (images a bit larger than `size`),
    at least `images` of each: the timed loops never reach the end of an epoch."""
    from src.data.sample_data import write_sample_data
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


PHOTO_SIZE, PHOTO_RESIZE = 224, 256  # the ImageNet pipelines: train crop and eval center crop, eval short side


def native_imagenet_dataset(path: str, *, training: bool, batch: int, workers: int):
    """MindSpore's C++ ImageNet pipeline as the model zoo builds it (for comparison only): decode
    with the random crop, flip, normalize, HWC->CHW; eval: decode, resize 256, center crop 224."""
    import mindspore as ms
    import mindspore.dataset as ds
    import mindspore.dataset.transforms as transforms
    import mindspore.dataset.vision as vision

    from src.dataset import IMAGENET_MEAN, IMAGENET_STD
    data = ds.ImageFolderDataset(path, num_parallel_workers=workers, shuffle=training)
    if training:
        ops = [vision.RandomCropDecodeResize(PHOTO_SIZE, scale=(0.08, 1.0), ratio=(0.75, 1.333)),
               vision.RandomHorizontalFlip(prob=0.5)]
    else:
        ops = [vision.Decode(), vision.Resize(PHOTO_RESIZE), vision.CenterCrop(PHOTO_SIZE)]
    ops += [vision.Normalize(mean=[m * 255 for m in IMAGENET_MEAN], std=[s * 255 for s in IMAGENET_STD]),
            vision.HWC2CHW()]
    data = data.map(operations=ops, input_columns="image", num_parallel_workers=workers)
    data = data.map(operations=transforms.TypeCast(ms.int32), input_columns="label", num_parallel_workers=workers)
    return data.batch(batch, drop_remainder=True)


def our_imagenet_dataset(path: str, *, training: bool, batch: int, workers: int, antialias: bool = True):
    """This repository's pipeline on the same folder."""
    from src.dataset import create_dataset
    return create_dataset("imagenet2012", path, training=training, batch_size=batch, image_size=PHOTO_SIZE,
                          num_parallel_workers=workers, antialias=antialias)


def plain_imagenet_dataset(path: str, *, training: bool, batch: int, workers: int):
    """This repository's pipeline resizing training crops without antialiasing, as the native one does."""
    return our_imagenet_dataset(path, training=training, batch=batch, workers=workers, antialias=False)


def recipe_imagenet_dataset(path: str, *, training: bool, batch: int, workers: int):
    """This repository's training pipeline with the modern recipe's per-sample work on:
    TrivialAugmentWide and random erasing (p 0.1), as resnet50_imagenet2012_v2.yaml trains."""
    from src.dataset import Augmentation, create_dataset
    return create_dataset("imagenet2012", path, training=training, batch_size=batch, image_size=PHOTO_SIZE,
                          num_parallel_workers=workers,
                          augmentation=Augmentation(auto_augment="ta_wide", random_erase=0.1))


def dataset_rate(data, batches: int) -> float:
    """img/s of a batched dataset over `batches` batches after one start-up batch (epochs repeat)."""
    iterator = data.repeat(-1).create_tuple_iterator(num_epochs=1, output_numpy=True)
    next(iterator)
    start, images = time.perf_counter(), 0
    for _ in range(batches):
        images += len(next(iterator)[1])
    return round(images / (time.perf_counter() - start), 1)


PIPELINES = {"ours": our_imagenet_dataset, "plain": plain_imagenet_dataset, "native": native_imagenet_dataset,
             "recipe": recipe_imagenet_dataset}
PHASES = {"ours": ("train", "eval"), "plain": ("train",), "native": ("train", "eval"), "recipe": ("train",)}


def measure_pipelines(path: str, *, batch: int, workers: int, batches: int, repeats: int) -> Dict[str, float]:
    """img/s of our and the native pipeline, train and eval, alternating repeat by repeat (medians)."""
    rates: Dict[str, List[float]] = {}
    for _ in range(repeats):
        for name, build in PIPELINES.items():
            for phase in PHASES[name]:
                data = build(path, training=phase == "train", batch=batch, workers=workers)
                rates.setdefault(f"{name}_{phase}", []).append(dataset_rate(data, batches))
    return {key: round(float(np.median(values)), 1) for key, values in rates.items()}


def serve_pipelines(args: argparse.Namespace) -> int:
    """A measuring process for the ImageNet pipelines, confined to its first --cores cores."""
    cores = sorted(os.sched_getaffinity(0))[:args.cores]
    os.sched_setaffinity(0, cores)  # threads started from here on inherit the mask
    batches = max(2, 2 * args.photos // args.photo_batch)
    result = measure_pipelines(args.photo_dir, batch=args.photo_batch, workers=args.workers, batches=batches,
                               repeats=args.repeats)
    print(REPLY + json.dumps({"cores": len(cores), "workers": args.workers, **result}), flush=True)
    return 0


def pipeline_settings() -> List[Tuple[int, int]]:
    """(cores, workers) to measure: one worker pinned to one core, then 1 and 2 workers on 2 cores."""
    from src.device import available_cores
    return [(1, 1)] + ([(2, 1), (2, 2)] if available_cores() >= 2 else [])


def benchmark_pipelines(args: argparse.Namespace, data_root: str) -> Dict:
    """Our ImageNet pipeline against the native one on the same photograph-like JPEGs, per core."""
    from src.data.photo_data import describe_files, write_photo_folder
    folder = os.path.join(data_root, "photos")
    files = describe_files(write_photo_folder(folder, args.photos))
    rows = []
    for cores, workers in pipeline_settings():
        command = [sys.executable, os.path.abspath(__file__), "--worker", "pipelines", "--photo_dir", folder,
                   "--photos", str(args.photos), "--photo_batch", str(args.photo_batch), "--cores", str(cores),
                   "--workers", str(workers), "--repeats", str(args.repeats)]
        row = _reply_of(subprocess.run(command, stdout=subprocess.PIPE, text=True,
                                       cwd=os.path.dirname(os.path.abspath(__file__))), "pipelines")
        row["train_ours_over_native"] = round(row["ours_train"] / row["native_train"], 3)
        row["train_plain_over_native"] = round(row["plain_train"] / row["native_train"], 3)
        row["eval_ours_over_native"] = round(row["ours_eval"] / row["native_eval"], 3)
        row["recipe_cost_over_plain"] = round(row["ours_train"] / row["recipe_train"], 3)  # time per sample
        rows.append(row)
    from src.data.image_decode import decoder_name
    return {"files": files, "decoder": decoder_name(), "batch_size": args.photo_batch, "image_size": PHOTO_SIZE,
            "rows": rows}


def _reply_of(result: subprocess.CompletedProcess, what: str) -> Dict:
    for line in result.stdout.splitlines():
        if line.startswith(REPLY):
            return json.loads(line[len(REPLY):])
    raise RuntimeError(f"the {what} benchmark process ended without a result (exit {result.returncode})")


def format_pipeline_table(section: Dict) -> str:
    files = section["files"]
    lines = [f"ImageNet input pipelines, {files['files']} generated photographs (mean {files['mean_file_kb']} KB, "
             f"PIL full decode {files['pil_decode_ms']} ms/image), batch {section['batch_size']}, "
             f"{section['image_size']}px, float32 out; our JPEG decoder: {section['decoder']}",
             f"  {'cores / workers':<18}{'ours train':>12}{'native train':>14}{'ratio':>8}{'no-aa train':>13}"
             f"{'ratio':>8}{'ours eval':>12}{'native eval':>14}{'ratio':>8}{'recipe train':>14}{'cost':>7}"]
    for row in section["rows"]:
        setting = f"{row['cores']} / {row['workers']}" + (" (pinned)" if row["cores"] == 1 else "")
        lines.append(f"  {setting:<18}{row['ours_train']:>12}{row['native_train']:>14}"
                     f"{row['train_ours_over_native']:>8}{row['plain_train']:>13}{row['train_plain_over_native']:>8}"
                     f"{row['ours_eval']:>12}{row['native_eval']:>14}"
                     f"{row['eval_ours_over_native']:>8}{row['recipe_train']:>14}{row['recipe_cost_over_plain']:>7}")
    lines.append("  img/s; ratio: ours / native (MindSpore's C++ pipeline as the model zoo builds it); no-aa: ours with "
                 "antialias False (resizing as the native pipeline does); recipe train: ours with TrivialAugmentWide + "
                 "random erasing 0.1, cost: its time per sample / ours train's")
    return "\n".join(lines) + "\n"


REPLY = "BENCHMARK-REPLY "


def serve(args: argparse.Namespace) -> int:
    """A measuring process for one framework: builds its runner, then answers commands on stdin
    ('measure', 'data ROOT', 'quit') with one JSON line each. The two frameworks never share a
    process: PyTorch beside an initialized MindSpore ran at half its own speed here."""
    if args.worker == "mindspore":
        from src.device import init_device
        init_device("CPU", mode_name="GRAPH", cpu_threads=args.threads)
        runner = MindSporeRunner(args.net, args.batch_size, args.image_size)
    elif args.worker in ONNX_WORKERS:
        runner = OnnxRunner(args.onnx_files.split(","), args.threads, host_normalize=args.worker == "onnxruntime_hostnorm")
    else:
        runner = TorchRunner(args.net, args.batch_size, args.image_size, args.threads)

    def reply(value) -> None:
        print(REPLY + json.dumps(value), flush=True)

    first = {"compile_s": runner.compile_seconds()}
    reply({**first, "model": runner.summary()} if args.worker == "mindspore" else first)
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "measure":
            reply(measure_runner(runner, args.batch_size, steps=args.steps, repeats=1, calls=args.calls))
        elif command == "export":
            reply({"onnx_files": runner.export_onnx(argument, args.batch_size, args.image_size),
                   "pixel_files": runner.export_onnx(argument, args.batch_size, args.image_size, pixels=True)})
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

    def __init__(self, framework: str, net_name: str, batch: int, size: int, args: argparse.Namespace,
                 extra: Sequence[str] = ()):
        command = [sys.executable, os.path.abspath(__file__), "--worker", framework, "--net", net_name,
                   "--batch_size", str(batch), "--image_size", str(size), "--threads", str(args.threads),
                   "--workers", str(args.workers), "--steps", str(args.steps), "--calls", str(args.calls), *extra]
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
        if importlib.util.find_spec("onnxruntime") is not None:
            folder = os.path.join(data_root, f"onnx_{net_name}_{batch}_{size}")
            os.makedirs(folder)
            exported = workers[0].ask("export " + folder)
            files = exported["onnx_files"]
            for kind, paths in (("onnxruntime", files), ("onnxruntime_hostnorm", files),
                                ("onnxruntime_pixels", exported["pixel_files"])):
                workers.append(Worker(kind, net_name, batch, size, args, ["--onnx_files", ",".join(paths)]))
            if importlib.util.find_spec("onnx") is not None:
                workers.append(Worker("onnxruntime_int8", net_name, batch, size, args,
                                      ["--onnx_files", ",".join(int8_files(files, size))]))
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
    report["model"] = model_figures(report)
    return report


def model_figures(report: Dict) -> Dict:
    """The model summary beside the measured speeds: achieved GFLOP/s (torchvision's GFLOPs, i.e.
    multiply-accumulates; a training step counted as three forward passes)."""
    from src.training.model_summary import TRAIN_PASSES
    measured = report["mindspore"]
    model = measured.pop("model")
    achieved = {"train": model["gflops"] * TRAIN_PASSES * measured["train_compute_img_per_s"]}
    achieved.update({label: model["gflops"] * measured[label]["img_per_s"]
                     for label in measured if label.startswith("eval_batch_")})
    return {**model, "achieved_gflop_per_s": {k: round(v, 2) for k, v in achieved.items()}}


def model_line(r: Dict) -> str:
    from src.training.model_summary import format_gflops
    model = r["model"]
    achieved = ", ".join(f"{name.replace('_', ' ')} {value}" for name, value in model["achieved_gflop_per_s"].items())
    return (f"  model: {model['trainable_parameters']:,} trainable parameters, {format_gflops(model['gflops'])} "
            f"GFLOPs per image at {model['image_size']} px, weights {model['checkpoint_mb']:.1f} MiB; "
            f"achieved GFLOP/s (MindSpore): {achieved}")


def int8_files(files: Sequence[str], size: int) -> List[str]:
    """The float ONNX files quantized as export.py --quantize int8 does, beside them. Calibrated
    on two seeded random batches: int8 kernels run at the same speed whatever the ranges (the
    accuracy of a properly calibrated file: eval.py --model_file)."""
    from src.deploy.inference import ExportedModel, seeded_input
    from src.deploy.quantize import quantize_onnx
    quantized = []
    for path in files:
        batch = ExportedModel(path).fixed_batch
        target = path[:-len(".onnx")] + "_int8.onnx"
        with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as workdir:
            quantize_onnx(path, target, (seeded_input(batch, size, size, seed=i) for i in range(2)), num_batches=2,
                          workdir=workdir)
        quantized.append(target)
    return quantized


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
    for path in ("onnxruntime", "onnxruntime_int8", "onnxruntime_pixels"):
        for label in [k for k in report.get(path, {}) if k.startswith("eval_batch_")]:
            others = ("onnxruntime", "onnxruntime_hostnorm") if path == "onnxruntime_pixels" else \
                ("mindspore", "torch", "onnxruntime")
            for other in others:
                if other in report and other != path:
                    ratios[f"{label}_{path}_over_{other}"] = round(
                        report[path][label]["img_per_s"] / report[other][label]["img_per_s"], 3)
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
        lines.append(model_line(r))
        if "onnxruntime" in r:
            lines += _deployment_rows(r)
        lines.append("")
    return "\n".join(lines)


def _deployment_rows(r: Dict) -> List[str]:
    """CPU inference paths side by side: MindSpore, PyTorch eager, the ONNX export under onnxruntime
    (float, and int8 where onnx is installed), with the speed-ups of the ONNX files."""
    paths = [name for name in ("mindspore", "torch", "onnxruntime", "onnxruntime_hostnorm", "onnxruntime_pixels",
                               "onnxruntime_int8") if name in r]
    titles = {"mindspore": "MindSpore", "torch": "PyTorch", "onnxruntime": "onnxruntime", "onnxruntime_int8": "ort int8",
              "onnxruntime_hostnorm": "ort+norm", "onnxruntime_pixels": "ort pixels"}
    short = {"onnxruntime": "ort", "onnxruntime_int8": "int8", "onnxruntime_hostnorm": "norm",
             "onnxruntime_pixels": "pixels"}
    speedups = [(p, other) for p, others in (("onnxruntime", ("mindspore", "torch")),
                                             ("onnxruntime_pixels", ("onnxruntime_hostnorm",)),
                                             ("onnxruntime_int8", ("onnxruntime", "torch")))
                for other in others if p in r and other in r]
    lines = [f"  {'CPU inference (eval mode)':<38}" + "".join(f"{titles[p]:>14}" for p in paths)
             + "".join(f"{short[p] + '/' + short.get(other, titles[other]):>16}" for p, other in speedups)]
    for label in [k for k in r["onnxruntime"] if k.startswith("eval_batch_")]:
        values = [r[p][label]["img_per_s"] for p in paths]
        ratios = [r["ratios"][f"{label}_{p}_over_{other}"] for p, other in speedups]
        lines.append(f"  {label.replace('_', ' ') + ' img/s':<38}" + "".join(f"{v:>14}" for v in values)
                     + "".join(f"{v:>16}" for v in ratios))
        lines.append(f"  {label.replace('_', ' ') + ' p50 ms':<38}"
                     + "".join(f"{r[p][label]['latency_ms']['p50']:>14.1f}" for p in paths))
    lines.append(f"  onnxruntime: the ONNX export (export.py) in the session predict.py uses, {r['threads']} threads; "
                 f"ort+norm: the same file after host normalization of a uint8 NHWC batch; ort pixels: the file "
                 f"exported with the input stage (--export_input_stage True) on that uint8 batch")
    if "onnxruntime_int8" in r:
        lines.append("  ort int8: the same files quantized as export.py --quantize int8 does (QDQ, per-channel weights)")
    return lines


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
    parser.add_argument("--photos", type=positive_int, default=256,
                        help="generated photographs for the ImageNet pipeline comparison")
    parser.add_argument("--photo_batch", type=positive_int, default=32, help="batch size of the pipeline comparison")
    parser.add_argument("--worker", choices=("mindspore", "torch", "pipelines") + ONNX_WORKERS, help=argparse.SUPPRESS)
    parser.add_argument("--photo_dir", help=argparse.SUPPRESS)
    parser.add_argument("--cores", type=positive_int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--onnx_files", help=argparse.SUPPRESS)
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
        if args.photo_batch > args.photos:
            parser.error(f"argument --photo_batch: {args.photo_batch} is more than --photos {args.photos}; "
                         f"lower it or generate more photographs")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker == "pipelines":
        return serve_pipelines(args)
    if args.worker:
        return serve(args)
    if args.vs_torch and importlib.util.find_spec("torch") is None:
        from src.migration.convert_torch import INSTALL_HINT
        raise UserInputError(f"--vs-torch needs PyTorch, which is not installed; {INSTALL_HINT}")
    configs = PRESETS[args.preset] if args.preset else [(args.net, args.batch_size, args.image_size)]
    reports = []
    with tempfile.TemporaryDirectory(prefix="benchmark-") as data_root:
        for net_name, batch, size in configs:
            reports.append(benchmark(net_name, batch, size, args, data_root))
        pipelines = benchmark_pipelines(args, data_root)
    print(format_table(reports))
    print(format_pipeline_table(pipelines))
    if args.json:
        from src.files import write_atomic
        write_atomic(args.json, json.dumps({"reports": reports, "imagenet_pipelines": pipelines}, indent=2) + "\n")
        print(f"report written to {args.json}")
    return 0


if __name__ == "__main__":
    run_cli(main)
