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
Then the input pipelines, this repository's (create_dataset: uint8 batches) against MindSpore's
native one as the model zoo builds it (float32 batches), one worker pinned to one core, then 1 and
2 workers on 2 cores, each setting in a process of its own, pipelines alternating repeat by repeat:
the per-process ceiling on --ceiling_images 16x16 JPEGs (plain and v2 recipe, worker processes and
threads), --photos generated photograph-like JPEGs and as many real ones (matplotlib's sample
photograph re-cropped at ImageNet sizes), train and eval, and CIFAR-10 at 32 px; with each, the
training process's own CPU time per sample, and from them the host cores one Ascend card needs.
Everything is fp32 on the CPU.
Each configuration also lists the model's parameters, GFLOPs per image at its size (torchvision's
convention: multiply-accumulates) and the GFLOP/s its training and evaluation achieved.
"""
import argparse
import functools
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from src.cpu import cpu_model
from src.data.host_stage import host_normalize, normalization_of
from src.errors import OneLineParser, UserInputError, run_cli
from src.openmp import set_openmp_environment

IMAGENET = normalization_of("imagenet2012")  # the benchmark's networks take ImageNet-normalized input
PRESETS = {"targets": [("resnet50", 8, 224), ("resnet18", 64, 32)]}
CLASSES = 10
ONNX_WORKERS = ("onnxruntime", "onnxruntime_hostnorm", "onnxruntime_pixels", "onnxruntime_int8")
# The training step's recipe: the step train.py builds for this config (create_train_step), on the
# benchmark's network, batch and size.
TRAIN_CONFIG = "config/resnet50_imagenet2012.yaml"
# MindSpore with its own convolutions, with this repository's oneDNN layers (float32; bfloat16 under
# amp on CPUs with AMX): the cpu_convolution and amp_level each runs with.
# cpu_convolution, amp_level, cpu_amp_dtype of each MindSpore worker.
MINDSPORE_WORKERS = {"mindspore": ("mindspore", "O0", "auto"), "ours": ("onednn", "O0", "auto"),
                     "ours_bf16": ("onednn", "O2", "bfloat16")}
# PyTorch eager: NCHW float32, channels_last float32, bfloat16 autocast with channels_last.
TORCH_WORKERS = {"torch": ("nchw", False), "torch_cl": ("channels_last", False), "torch_bf16": ("channels_last", True)}
LABELS = {"mindspore": "MindSpore convolutions", "ours": "ours (oneDNN, blocked)", "ours_bf16": "ours, bf16",
          "torch": "PyTorch NCHW", "torch_cl": "PyTorch channels_last", "torch_bf16": "PyTorch bf16 autocast+CL"}
BREAKDOWN_MARK = "BREAKDOWN "
# --cpu_isa: the cap for our oneDNN (library.ISAS) and the same cap for PyTorch (ATEN_CPU_CAPABILITY,
# ONEDNN_MAX_CPU_ISA for its oneDNN), so every path runs as on a CPU without the instructions above it.
CPU_ISAS = {"all": (None, None), "avx2": ("avx2", "AVX2"), "avx512_core": ("avx512", "AVX512_CORE"),
            "avx512_core_bf16": ("avx512", "AVX512_CORE_BF16"), "avx512_core_amx": ("avx512", "AVX512_CORE_AMX")}


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


def train_config(net_name: str, batch: int, size: int, cpu_convolution: str, amp_level: str):
    """TRAIN_CONFIG for the benchmark's network, batch, size and classes, on CPU."""
    from src.config import load_config
    return load_config(["--config_path", TRAIN_CONFIG, "--net_name", net_name, "--class_num", str(CLASSES),
                        "--batch_size", str(batch), "--train_image_size", str(size), "--device_target", "CPU",
                        "--cpu_convolution", cpu_convolution, "--amp_level", amp_level], prog="benchmark.py")


class MindSporeRunner:
    """Train and eval steps in GRAPH mode: the training step train.py builds for TRAIN_CONFIG
    (create_train_step: finiteness check, BatchNorm restore on a skipped step, loss scale, ...),
    with `convolutions` (create_model's)."""

    name = "mindspore"

    def __init__(self, net_name: str, batch: int, size: int, cfg=None, convolutions: str = "mindspore"):
        import mindspore as ms

        from src.resnet import create_model
        from src.training.train_step import ReadyInput
        from train import create_train_step
        cfg = cfg or train_config(net_name, batch, size, "mindspore", "O0")
        self.net = create_model(net_name, num_classes=CLASSES, convolutions=convolutions)
        self.train_cell = create_train_step(cfg, self.net, np.full(100_000, 0.01, np.float32), ema=None,
                                            input_stage=ReadyInput())
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
        outputs = self.train_cell(self.images if images is None else images,
                                  self.labels if labels is None else labels)
        outputs[0].asnumpy()

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
        from src.data.input_stage import WithInputStage
        self._set_training(False)
        net = WithInputStage(self.net, normalization_of("imagenet2012")) if pixels else self.net
        net.set_train(False)
        return [export_network(net, file_name=f"{self.name}{'_pixels' if pixels else ''}_b{n}", file_format="ONNX",
                               batch_size=n, height=size, width=size, staging=folder, pixels=pixels)
                for n in (1, batch)]


class TorchRunner:
    """The same ResNet, SGD with momentum and cross-entropy in PyTorch eager: float32 in NCHW or
    channels_last, or bfloat16 autocast."""

    name = "torch"

    def __init__(self, net_name: str, batch: int, size: int, threads: int, memory_format: str = "nchw",
                 bf16: bool = False):
        import torch

        from src.migration import torch_resnet
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        self.torch = torch
        layout = torch.channels_last if memory_format == "channels_last" else torch.contiguous_format
        self.net = getattr(torch_resnet, net_name)(num_classes=CLASSES).to(memory_format=layout)
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
        self.loss = torch.nn.CrossEntropyLoss()
        self.images = torch.rand(batch, 3, size, size).contiguous(memory_format=layout)
        self.labels = torch.arange(batch) % CLASSES
        self.one = torch.rand(1, 3, size, size).contiguous(memory_format=layout)
        self.autocast = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16, enabled=bf16)

    def compile_seconds(self) -> float:
        self.train_step()
        return 0.0  # eager: nothing to compile

    def train_step(self) -> None:
        self.net.train()
        self.optimizer.zero_grad(set_to_none=True)
        with self.autocast():
            loss = self.loss(self.net(self.images), self.labels)
        loss.backward()
        self.optimizer.step()

    def eval_step(self, single: bool) -> None:
        self.net.eval()
        with self.torch.no_grad(), self.autocast():
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
            feed = {name: host_normalize(pixels, IMAGENET) for name, pixels in feed.items()}
        self.sessions[index].run(None, feed)


def measure_runner(runner, batch: int, *, steps: int, repeats: int, calls: int) -> Dict:
    result = {}
    if getattr(runner, "trains", True):
        result["train_compute_img_per_s"] = median_rate(runner.train_step, batch, steps=steps, repeats=repeats)
    for label, single in (("eval_batch_1", True), (f"eval_batch_{batch}", False)):
        runner.eval_step(single)  # warm-up (compiles the inference graph once)
        result[label] = latency(functools.partial(runner.eval_step, single), 1 if single else batch, calls)
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
    """Training img/s with batches coming from the real pipeline (uint8 batches normalized by the
    input stage's cell, as the training step's first cell does)."""
    from src.data.input_stage import NormalizeImages
    from src.dataset import create_dataset
    data = create_dataset(dataset, path, training=True, batch_size=batch, image_size=size,
                          num_parallel_workers=workers)
    normalize = NormalizeImages(data.normalization)
    iterator = data.create_tuple_iterator(num_epochs=-1)

    def step() -> None:
        images, labels = next(iterator)
        runner.train_step(normalize(images), labels)
    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return round(batch * steps / (time.perf_counter() - start), 2)


PHOTO_SIZE, PHOTO_RESIZE = 224, 256  # the ImageNet pipelines: train crop and eval center crop, eval short side
CIFAR_SIZE = 32
CIFAR_RECORDS = 10_000  # MindSpore's Cifar10Dataset rejects files with fewer records
CARD_IMG_PER_S = 2170  # the model zoo's ResNet50 on one Ascend 910 card: 118 ms per 256-image step
# resnet50_imagenet2012_v2.yaml's data recipe (TrivialAugmentWide, erasing, mixup/cutmix, repeated augmentation)
V2_RECIPE = {"auto_augment": "ta_wide", "random_erase": 0.1, "mixup_alpha": 0.2, "cutmix_alpha": 1.0, "ra_reps": 4}


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


def native_cifar_dataset(path: str, *, training: bool, batch: int, workers: int):
    """MindSpore's C++ CIFAR-10 training pipeline as the model zoo builds it, at 32 px: random crop
    with 4 pixels of padding, flip, rescale, normalize, HWC->CHW."""
    import mindspore as ms
    import mindspore.dataset as ds
    import mindspore.dataset.transforms as transforms
    import mindspore.dataset.vision as vision

    from src.dataset import CIFAR_MEAN, CIFAR_STD
    data = ds.Cifar10Dataset(path, usage="train", num_parallel_workers=workers, shuffle=training)
    ops = [vision.RandomCrop((CIFAR_SIZE, CIFAR_SIZE), (4, 4, 4, 4)), vision.RandomHorizontalFlip(prob=0.5),
           vision.Rescale(1.0 / 255.0, 0.0), vision.Normalize(mean=list(CIFAR_MEAN), std=list(CIFAR_STD)),
           vision.HWC2CHW()]
    data = data.map(operations=ops, input_columns="image", num_parallel_workers=workers)
    data = data.map(operations=transforms.TypeCast(ms.int32), input_columns="label", num_parallel_workers=workers)
    return data.batch(batch, drop_remainder=True)


def our_dataset(path: str, *, training: bool, batch: int, workers: int, dataset: str = "imagenet2012",
                worker_kind: str = "process", **options):
    """This repository's pipeline (create_dataset) on the same files; `options` are its keyword arguments."""
    from src.dataset import Augmentation, create_dataset
    recipe = Augmentation(**options.pop("recipe", {}))
    size = CIFAR_SIZE if dataset == "cifar10" else PHOTO_SIZE
    return create_dataset(dataset, path, training=training, batch_size=batch, image_size=size, class_num=10,
                          num_parallel_workers=workers, worker_kind=worker_kind, augmentation=recipe, **options)


# What each pipeline process measures: case -> (data folder, {pipeline: (builder, training)}).
PIPELINE_CASES = {
    "ceiling": ("tiny", {
        "ours": (functools.partial(our_dataset), True),
        "ours_threads": (functools.partial(our_dataset, worker_kind="thread"), True),
        "v2": (functools.partial(our_dataset, recipe=V2_RECIPE), True),
        "native": (native_imagenet_dataset, True)}),
    "photos": ("photos", {
        "ours_train": (our_dataset, True),
        "no_aa_train": (functools.partial(our_dataset, antialias=False), True),
        "v2_train": (functools.partial(our_dataset, recipe=V2_RECIPE), True),
        "native_train": (native_imagenet_dataset, True),
        "ours_eval": (our_dataset, False),
        "native_eval": (native_imagenet_dataset, False)}),
    "real": ("real", {
        "ours_train": (our_dataset, True),
        "native_train": (native_imagenet_dataset, True),
        "ours_eval": (our_dataset, False),
        "native_eval": (native_imagenet_dataset, False)}),
    "photos_shards": ("photos_shards", {"ours_train": (our_dataset, True), "ours_eval": (our_dataset, False)}),
    "real_shards": ("real_shards", {"ours_train": (our_dataset, True), "ours_eval": (our_dataset, False)}),
    "cifar": ("cifar", {
        "ours": (functools.partial(our_dataset, dataset="cifar10"), True),
        "v2": (functools.partial(our_dataset, dataset="cifar10", recipe=V2_RECIPE), True),
        "native": (native_cifar_dataset, True)}),
}


def dataset_rate(data, batches: int) -> Tuple[float, float]:
    """img/s of a batched dataset over `batches` batches after one start-up batch (epochs repeat),
    and the main process's own CPU time per sample in microseconds (getrusage: all its threads,
    not its worker processes): the cost no number of workers takes off the training process."""
    iterator = data.repeat(-1).create_tuple_iterator(num_epochs=1, output_numpy=True)
    next(iterator)
    start, cpu_start, images = time.perf_counter(), _own_cpu_seconds(), 0
    for _ in range(batches):
        images += len(next(iterator)[1])
    elapsed, cpu = time.perf_counter() - start, _own_cpu_seconds() - cpu_start
    return round(images / elapsed, 1), round(cpu / images * 1e6, 1)


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure_pipelines(folders: Dict[str, str], *, batch: int, workers: int, batches: Dict[str, int],
                      repeats: int) -> Dict[str, Dict[str, Dict[str, float]]]:
    """Every case's pipelines, alternating repeat by repeat: medians of img/s and of the main
    process's CPU microseconds per sample."""
    samples: Dict[Tuple[str, str], List[Tuple[float, float]]] = {}
    for _ in range(repeats):
        for case, (folder, pipelines) in PIPELINE_CASES.items():
            for name, (build, training) in pipelines.items():
                if name.endswith("threads") and workers < 2:
                    continue  # one worker is a thread either way
                data = build(folders[folder], training=training, batch=batch, workers=workers)
                samples.setdefault((case, name), []).append(dataset_rate(data, batches[folder]))
    result: Dict[str, Dict[str, Dict[str, float]]] = {}
    for (case, name), values in samples.items():
        rates, cpus = zip(*values)
        result.setdefault(case, {})[name] = {"img_per_s": round(float(np.median(rates)), 1),
                                             "main_cpu_us": round(float(np.median(cpus)), 1)}
    return result


def serve_pipelines(args: argparse.Namespace) -> int:
    """A measuring process for the input pipelines, confined to its first --cores cores."""
    cores = sorted(os.sched_getaffinity(0))[:args.cores]
    os.sched_setaffinity(0, cores)  # threads and worker processes started from here on inherit the mask
    folders = json.loads(args.photo_dir)
    small, photos = max(2, args.ceiling_images // args.photo_batch), max(2, 2 * args.photos // args.photo_batch)
    batches = {"tiny": small, "photos": photos, "real": photos, "photos_shards": photos, "real_shards": photos,
               "cifar": small}
    result = measure_pipelines(folders, batch=args.photo_batch, workers=args.workers, batches=batches,
                               repeats=args.repeats)
    print(REPLY + json.dumps({"cores": len(cores), "workers": args.workers, **result}), flush=True)
    return 0


# stat()ed around the counted batches: where they start and end in strace's log
STORAGE_MARK = "/benchmark-storage-mark"
STORAGE_CALLS = "openat,open,read,pread64,readv,preadv,newfstatat,stat,statx"
READ_CALLS = ("read", "pread64", "readv", "preadv")


def serve_storage(args: argparse.Namespace) -> int:
    """The process strace watches: the training pipeline on --photo_dir (one worker), one batch to
    start, then --steps batches between two marks."""
    data = our_dataset(args.photo_dir, training=True, batch=args.photo_batch, workers=1)
    iterator = data.repeat(-1).create_tuple_iterator(num_epochs=1, output_numpy=True)
    next(iterator)
    _mark()
    samples = sum(len(next(iterator)[1]) for _ in range(args.steps))
    _mark()
    print(REPLY + json.dumps({"samples": samples}), flush=True)
    return 0


def _mark() -> None:
    try:
        os.stat(STORAGE_MARK)
    except FileNotFoundError:
        pass


def storage_calls(path: str, *, batch: int, batches: int) -> Optional[Dict[str, float]]:
    """Files opened and read calls on the data's files per 1,000 training samples, counted by
    strace over the process, its threads and workers: what a network file system charges per call,
    which this machine's page cache hides. None without strace."""
    if shutil.which("strace") is None:
        return None
    with tempfile.TemporaryDirectory(prefix="storage-calls-") as folder:
        log = os.path.join(folder, "calls.log")
        command = ["strace", "-f", "--seccomp-bpf", "-y", "-qq", "-e", f"trace={STORAGE_CALLS}", "-o", log,
                   sys.executable, os.path.abspath(__file__), "--worker", "storage", "--photo_dir", path,
                   "--photo_batch", str(batch), "--steps", str(batches)]
        reply = _reply_of(subprocess.run(command, stdout=subprocess.PIPE, text=True,
                                         cwd=os.path.dirname(os.path.abspath(__file__))), "storage")
        opened, reads = count_storage_calls(log, os.path.realpath(path))
    per_thousand = 1000 / reply["samples"]
    return {"files_opened": round(opened * per_thousand, 1), "read_calls": round(reads * per_thousand, 1)}


def count_storage_calls(log: str, root: str) -> Tuple[int, int]:
    """(files opened under `root`, read calls on them) between the two marks of an strace -f -y log."""
    opened = reads = 0
    inside = False
    with open(log) as lines:
        for line in lines:
            if STORAGE_MARK in line:
                inside = not inside
                continue
            call = line.split(" ", 1)[-1].lstrip()
            name = call.split("(", 1)[0]
            if not inside or call.startswith("<..."):
                continue  # a call resumed was counted where it started
            if name in ("open", "openat") and f'"{root}' in call and " = -1 " not in call:
                opened += 1
            elif name in READ_CALLS and f"<{root}" in call.split(",", 1)[0]:
                reads += 1
    return opened, reads


def pipeline_settings() -> List[Tuple[int, int]]:
    """(cores, workers) to measure: one worker pinned to one core, then 1 and 2 workers on 2 cores."""
    from src.device import available_cores
    return [(1, 1)] + ([(2, 1), (2, 2)] if available_cores() >= 2 else [])


def write_pipeline_data(args: argparse.Namespace, data_root: str) -> Tuple[Dict[str, str], Dict]:
    """The pipelines' files: tiny JPEGs (the ceiling), generated and real photographs, CIFAR-10
    binary files of 10,000 records (MindSpore's reader takes no fewer); their folders and descriptions."""
    from src.data.photo_data import describe_files, write_photo_folder, write_real_photo_folder, write_tiny_jpegs
    folders = {name: os.path.join(data_root, name) for name in ("tiny", "photos", "real")}
    files = {"tiny": describe_files(write_tiny_jpegs(folders["tiny"], args.ceiling_images)),
             "photos": describe_files(write_photo_folder(folders["photos"], args.photos)),
             "real": describe_files(write_real_photo_folder(folders["real"], args.photos))}
    folders["cifar"] = write_cifar_records(os.path.join(data_root, "cifar"), CIFAR_RECORDS)
    for name in ("photos", "real"):
        folders[f"{name}_shards"] = write_shards(folders[name], os.path.join(data_root, f"{name}_shards"))
    return folders, files


def write_shards(folder: str, output: str) -> str:
    """`folder`'s class folders converted to MindRecord shards (src/data/mindrecord.py), 4 of them."""
    from src.data.mindrecord import convert_split
    from src.data.sources import ImageFolderSource
    convert_split(ImageFolderSource(folder, True), output, shards=4, workers=1, overwrite=False,
                  log=lambda line: None)
    return output


def write_cifar_records(folder: str, records: int) -> str:
    """A CIFAR-10 binary training file (data_batch_1.bin) of `records` random images, and a
    one-record test_batch.bin; the folder."""
    from src.data.sources import CIFAR_RECORD_BYTES
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, count in (("data_batch_1.bin", records), ("test_batch.bin", 1)):
        data = rng.integers(0, 256, (count, CIFAR_RECORD_BYTES), dtype=np.uint8)
        data[:, 0] %= 10
        data.tofile(os.path.join(folder, name))
    return folder


def benchmark_pipelines(args: argparse.Namespace, data_root: str) -> Dict:
    """Our input pipeline against MindSpore's native one on the same files, per core and with 1
    and 2 workers, each setting in a process of its own."""
    folders, files = write_pipeline_data(args, data_root)
    rows = []
    for cores, workers in pipeline_settings():
        command = [sys.executable, os.path.abspath(__file__), "--worker", "pipelines",
                   "--photo_dir", json.dumps(folders), "--photos", str(args.photos),
                   "--ceiling_images", str(args.ceiling_images), "--photo_batch", str(args.photo_batch),
                   "--cores", str(cores), "--workers", str(workers),
                   "--repeats", str(args.repeats)]
        rows.append(_reply_of(subprocess.run(command, stdout=subprocess.PIPE, text=True,
                                             cwd=os.path.dirname(os.path.abspath(__file__))), "pipelines"))
    from src.data.image_decode import decoder_name
    section = {"files": files, "decoder": decoder_name(), "batch_size": args.photo_batch, "image_size": PHOTO_SIZE,
               "rows": rows}
    section["ratios"] = pipeline_ratios(rows)
    section["cores_per_card"] = cores_per_card(rows)
    batches = max(2, 2 * args.photos // args.photo_batch)  # two epochs: the shards' reader starts once per epoch
    section["storage_calls"] = {name: storage_calls(folders[name], batch=args.photo_batch, batches=batches)
                                for name in ("photos", "photos_shards")}
    return section


def _rate(row: Dict, case: str, name: str) -> float:
    return row[case][name]["img_per_s"]


def pipeline_ratios(rows: List[Dict]) -> List[Dict[str, float]]:
    """Per row: ours over native (ceiling plain and v2, photographs generated and real, train and
    eval, CIFAR)."""
    pairs = {"ceiling_ours": ("ceiling", "ours", "native"), "ceiling_v2": ("ceiling", "v2", "native"),
             "photos_train": ("photos", "ours_train", "native_train"),
             "photos_eval": ("photos", "ours_eval", "native_eval"),
             "real_train": ("real", "ours_train", "native_train"), "real_eval": ("real", "ours_eval", "native_eval"),
             "cifar": ("cifar", "ours", "native")}
    ratios = [{key: round(_rate(row, case, ours) / _rate(row, case, native), 3)
               for key, (case, ours, native) in pairs.items()} for row in rows]
    for row, ratio in zip(rows, ratios):  # MindRecord shards over the class folder they were converted from
        for name in ("photos", "real"):
            for phase in ("train", "eval"):
                ratio[f"{name}_shards_{phase}"] = round(_rate(row, f"{name}_shards", f"ours_{phase}") /
                                                        _rate(row, name, f"ours_{phase}"), 3)
    return ratios


def cores_per_card(rows: List[Dict]) -> Dict[str, float]:
    """Host cores one card's ResNet50 (CARD_IMG_PER_S) needs from our training pipeline: the
    pinned one-core row's rate on photographs (worker and training process sharing the core),
    and the per-process ceiling as a multiple of the card's rate."""
    pinned = rows[0]
    widest = rows[-1]
    return {"card_img_per_s": CARD_IMG_PER_S,
            "generated_photos": round(CARD_IMG_PER_S / _rate(pinned, "photos", "ours_train"), 1),
            "real_photos": round(CARD_IMG_PER_S / _rate(pinned, "real", "ours_train"), 1),
            "v2_generated_photos": round(CARD_IMG_PER_S / _rate(pinned, "photos", "v2_train"), 1),
            "ceiling_over_card": round(_rate(widest, "ceiling", "ours") / CARD_IMG_PER_S, 2),
            "main_cpu_ceiling_img_per_s": round(1e6 / max(widest["ceiling"]["ours"]["main_cpu_us"], 1e-3))}


def _reply_of(result: subprocess.CompletedProcess, what: str) -> Dict:
    for line in result.stdout.splitlines():
        if line.startswith(REPLY):
            return json.loads(line[len(REPLY):])
    raise RuntimeError(f"the {what} benchmark process ended without a result (exit {result.returncode})")


def _setting(row: Dict) -> str:
    return f"{row['cores']} / {row['workers']}" + (" (pinned)" if row["cores"] == 1 else "")


def _cells(row: Dict, case: str, names: Sequence[str], width: int = 10) -> str:
    return "".join(f"{(_rate(row, case, name) if name in row[case] else '-'):>{width}}" for name in names)


def format_pipeline_table(section: Dict) -> str:
    files, rows, ratios = section["files"], section["rows"], section["ratios"]
    head = f"batch {section['batch_size']}, {section['image_size']} px, uint8 out (ours) / float32 out (native)"
    lines = [f"Input pipeline ceiling: {files['tiny']['files']} 16x16 JPEGs (decoding ~free), training transforms, "
             f"{head}",
             f"  {'cores / workers':<18}{'ours':>10}{'threads':>10}{'v2':>10}{'native':>10}{'ours/nat':>10}"
             f"{'v2/nat':>10}{'main us/img ours':>18}{'native':>8}"]
    for row, ratio in zip(rows, ratios):
        lines.append(f"  {_setting(row):<18}{_cells(row, 'ceiling', ('ours', 'ours_threads', 'v2', 'native'))}"
                     f"{ratio['ceiling_ours']:>10}{ratio['ceiling_v2']:>10}"
                     f"{row['ceiling']['ours']['main_cpu_us']:>18}{row['ceiling']['native']['main_cpu_us']:>8}")
    lines.append("  img/s; ours: create_dataset, plain recipe (worker processes; threads: data_worker_kind thread); "
                 "v2: "
                 "resnet50_imagenet2012_v2.yaml's recipe (TrivialAugmentWide, erasing, mixup/cutmix, ra_reps 4); "
                 "native: MindSpore's C++ pipeline as the model zoo builds it; main us/img: the training process's own "
                 "CPU per sample (getrusage)")
    lines.append(f"Photographs: generated {files['photos']['files']} (mean {files['photos']['mean_file_kb']} KB, PIL "
                 f"decode {files['photos']['pil_decode_ms']} ms) and real {files['real']['files']} (matplotlib's "
                 f"grace_hopper.jpg re-cropped; {files['real']['mean_file_kb']} KB, "
                 f"{files['real']['pil_decode_ms']} ms), "
                 f"{head}; our JPEG decoder: {section['decoder']}")
    lines.append(f"  {'cores / workers':<18}{'gen ours':>10}{'native':>10}{'ratio':>8}{'no-aa':>9}{'v2':>8}"
                 f"{'eval':>8}{'native':>8}{'ratio':>8}{'real ours':>11}{'native':>8}{'ratio':>8}{'eval':>8}"
                 f"{'native':>8}{'ratio':>8}")
    for row, ratio in zip(rows, ratios):
        lines.append(f"  {_setting(row):<18}{_cells(row, 'photos', ('ours_train', 'native_train'))}"
                     f"{ratio['photos_train']:>8}"
                     f"{_cells(row, 'photos', ('no_aa_train', 'v2_train', 'ours_eval', 'native_eval'), 8)[1:]}"
                     f"{ratio['photos_eval']:>8}{_cells(row, 'real', ('ours_train',), 11)}"
                     f"{_cells(row, 'real', ('native_train',), 8)}{ratio['real_train']:>8}"
                     f"{_cells(row, 'real', ('ours_eval', 'native_eval'), 8)}{ratio['real_eval']:>8}")
    lines.append(f"CIFAR-10 at {CIFAR_SIZE} px, training transforms, batch {section['batch_size']}")
    lines.append(f"  {'cores / workers':<18}{'ours':>10}{'v2':>10}{'native':>10}{'ratio':>8}{'main us/img':>13}")
    for row, ratio in zip(rows, ratios):
        lines.append(f"  {_setting(row):<18}{_cells(row, 'cifar', ('ours', 'v2', 'native'))}{ratio['cifar']:>8}"
                     f"{row['cifar']['ours']['main_cpu_us']:>13}")
    lines.append(f"MindRecord shards (4, python -m src.data.mindrecord) against the class folders they hold, "
                 f"batch {section['batch_size']}, {section['image_size']} px")
    lines.append(f"  {'cores / workers':<18}{'gen folder':>11}{'shards':>8}{'ratio':>8}{'eval':>8}{'shards':>8}"
                 f"{'ratio':>8}{'real folder':>13}{'shards':>8}{'ratio':>8}{'eval':>8}{'shards':>8}{'ratio':>8}")
    for row, ratio in zip(rows, ratios):
        lines.append(f"  {_setting(row):<18}{_cells(row, 'photos', ('ours_train',), 11)}"
                     f"{_cells(row, 'photos_shards', ('ours_train',), 8)}{ratio['photos_shards_train']:>8}"
                     f"{_cells(row, 'photos', ('ours_eval',), 8)}{_cells(row, 'photos_shards', ('ours_eval',), 8)}"
                     f"{ratio['photos_shards_eval']:>8}{_cells(row, 'real', ('ours_train',), 13)}"
                     f"{_cells(row, 'real_shards', ('ours_train',), 8)}{ratio['real_shards_train']:>8}"
                     f"{_cells(row, 'real', ('ours_eval',), 8)}{_cells(row, 'real_shards', ('ours_eval',), 8)}"
                     f"{ratio['real_shards_eval']:>8}")
    calls = section["storage_calls"]
    if calls["photos"] is None:
        lines.append("  storage calls: strace not found (install strace to count them)")
    else:
        folder, shards = calls["photos"], calls["photos_shards"]
        lines.append(f"  per 1,000 training samples (strace, one worker): class folder {folder['files_opened']} files "
                     f"opened, {folder['read_calls']} read calls; shards {shards['files_opened']} files opened, "
                     f"{shards['read_calls']} read calls")
    card = section["cores_per_card"]
    lines.append(f"Cores per Ascend card (ResNet50 at {card['card_img_per_s']} img/s) from the pinned row: "
                 f"{card['generated_photos']} (generated photographs), {card['real_photos']} (real), "
                 f"{card['v2_generated_photos']} (v2 recipe, generated); the widest row on the tiny JPEGs "
                 f"delivered {card['ceiling_over_card']}x a card's rate; the training process's own CPU "
                 f"allows ~{card['main_cpu_ceiling_img_per_s']} img/s (its ceiling on any host)")
    return "\n".join(lines) + "\n"


REPLY = "BENCHMARK-REPLY "


def serve(args: argparse.Namespace) -> int:
    """A measuring process for one framework: builds its runner, then answers commands on stdin
    ('measure', 'data ROOT', 'quit') with one JSON line each. The two frameworks never share a
    process: PyTorch beside an initialized MindSpore ran at half its own speed here."""
    if args.worker in MINDSPORE_WORKERS:
        runner = mindspore_runner(args)
    elif args.worker in ONNX_WORKERS:
        runner = OnnxRunner(args.onnx_files.split(","), args.threads,
                            host_normalize=args.worker == "onnxruntime_hostnorm")
    else:
        capability, onednn_isa = CPU_ISAS[args.cpu_isa]
        if capability:  # read when torch is imported
            os.environ.update(ATEN_CPU_CAPABILITY=capability, ONEDNN_MAX_CPU_ISA=onednn_isa)
        memory_format, bf16 = TORCH_WORKERS[args.worker]
        runner = TorchRunner(args.net, args.batch_size, args.image_size, args.threads, memory_format, bf16)
    if args.breakdown:
        return serve_breakdown(runner)

    def reply(value) -> None:
        print(REPLY + json.dumps(value), flush=True)

    first = {"compile_s": runner.compile_seconds()}
    reply({**first, "model": runner.summary()} if args.worker in MINDSPORE_WORKERS else first)
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


def mindspore_runner(args: argparse.Namespace) -> MindSporeRunner:
    """The device set up as train.py sets it for the worker's cpu_convolution and amp_level, and the
    runner; a path that cannot run here (our layers not built) is an error line."""
    set_openmp_environment()  # before the first import of MindSpore, in its workers alone (PyTorch keeps its default)
    from src.cpu_convolution import choose_convolutions, library, set_threads
    from src.device import init_device
    if args.cpu_isa != "all" and not library.unavailable_reason():
        library.cap_isa(args.cpu_isa)
    cpu_convolution, amp_level, cpu_amp_dtype = MINDSPORE_WORKERS[args.worker]
    cfg = train_config(args.net, args.batch_size, args.image_size, cpu_convolution, amp_level)
    convolutions, _ = choose_convolutions(cfg.cpu_convolution, device_target="CPU", amp_level=cfg.amp_level,
                                          cpu_amp_dtype=cpu_amp_dtype)
    threads = init_device("CPU", mode_name="GRAPH", cpu_threads=args.threads, cap_cpu_isa=convolutions == "mindspore")
    if convolutions != "mindspore":
        set_threads(threads)
    return MindSporeRunner(args.net, args.batch_size, args.image_size, cfg, convolutions)


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


BREAKDOWN_KINDS = {"convolution": "convolutions", "batch_normalization": "normalization", "pooling": "pooling",
                   "reorder": "layout reorders"}


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
    command = [sys.executable, os.path.abspath(__file__), "--worker", worker, "--breakdown", "--net", net_name,
               "--batch_size", str(batch), "--image_size", str(size), "--threads", str(args.threads),
               "--cpu_isa", args.cpu_isa]
    env = dict(os.environ, ONEDNN_VERBOSE="profile_exec")
    result = subprocess.run(command, capture_output=True, text=True, env=env,
                            cwd=os.path.dirname(os.path.abspath(__file__)))
    if result.returncode != 0:
        raise RuntimeError(f"the {worker} breakdown process failed (exit {result.returncode}): "
                           f"{result.stderr.strip().splitlines()[-1:]}")
    return step_breakdown(result.stdout)


def compute_paths(vs_torch: bool, cpu_features: Optional[Set[str]] = None, cpu_isa: str = "all") -> List[str]:
    """The workers to measure: MindSpore's convolutions, ours where they are built (in bfloat16 too
    where the CPU, or the ISA it is capped at, has bfloat16 instructions), and with --vs-torch
    PyTorch's NCHW, channels_last and bf16 autocast likewise. `cpu_features` stands in for this
    CPU's flags."""
    from src.cpu import cpu_flags
    from src.cpu_convolution import unavailable_reason
    flags = cpu_flags() if cpu_features is None else cpu_features
    bf16 = bool(flags & {"avx512_bf16", "amx_bf16"}) and cpu_isa not in ("avx2", "avx512_core")
    paths = ["mindspore"]
    reason = unavailable_reason()
    if reason:
        print(f"note: no rows for this repository's CPU layers: {reason}", flush=True)
    else:
        paths += ["ours"] + (["ours_bf16"] if bf16 else [])
    if vs_torch:
        paths += ["torch", "torch_cl"] + (["torch_bf16"] if bf16 else [])
    return paths


class Worker:
    """The orchestrator's handle on a measuring process."""

    def __init__(self, framework: str, net_name: str, batch: int, size: int, args: argparse.Namespace,
                 extra: Sequence[str] = ()):
        command = [sys.executable, os.path.abspath(__file__), "--worker", framework, "--net", net_name,
                   "--batch_size", str(batch), "--image_size", str(size), "--threads", str(args.threads),
                   "--workers", str(args.workers), "--steps", str(args.steps), "--calls", str(args.calls),
                   "--cpu_isa", args.cpu_isa, *extra]
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
              "workers": args.workers, "cpu_isa": args.cpu_isa,
              **cpu_capacity(net_name, batch, size, args.threads, args.cpu_isa)}
    workers = []
    try:
        for framework in compute_paths(args.vs_torch, cpu_isa=args.cpu_isa):
            workers.append(Worker(framework, net_name, batch, size, args))
        if importlib.util.find_spec("onnxruntime") is not None and not args.compute_only:
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
        data = {"pipeline_img_per_s": {}, "train_end_to_end_img_per_s": {}}
        if not args.compute_only:
            paths = write_data(os.path.join(data_root, f"{net_name}_{size}"), size,
                               images=(max(4, args.steps) + 2) * batch)
            data = workers[0].ask("data " + json.dumps(paths))
    finally:
        for worker in workers:
            worker.close()
    report["breakdown_ms"] = {worker.framework: measure_breakdown(worker.framework, net_name, batch, size, args)
                              for worker in workers if worker.framework in MINDSPORE_WORKERS}
    report["cpu"] = cpu_model()
    report["pipeline_img_per_s"] = data["pipeline_img_per_s"]
    report["mindspore"]["train_end_to_end_img_per_s"] = data["train_end_to_end_img_per_s"]
    report["ratios"] = _ratios(report)
    report["model"] = model_figures(report)
    report["gmacs_per_s"] = {path: achieved_gmacs(report, path) for path in (*MINDSPORE_WORKERS, *TORCH_WORKERS)
                             if path in report}
    return report


def cpu_capacity(net_name: str, batch: int, size: int, threads: int, cpu_isa: str = "all") -> Dict:
    """What train.py runs on this CPU (`default_path`; and with amp on, the precision its probe
    chooses, `amp_choice`), and this CPU's peak multiply-accumulate rates (`peak_gmacs`: a large
    oneDNN 1x1 convolution in float32 and bfloat16, null where there is none), measured before the
    workers start, on `threads` threads."""
    from src.cpu_convolution import choose_convolutions, library, unavailable_reason
    from src.resnet import probe_layers
    if unavailable_reason():
        return {"default_path": "mindspore", "amp_choice": None, "peak_gmacs": None}
    if cpu_isa != "all":
        library.cap_isa(cpu_isa)
    library.set_threads(threads)
    choice, note = choose_convolutions("auto", device_target="CPU", amp_level="O2", threads=threads,
                                       probe_layers=probe_layers(net_name, size, batch))
    peak = {"float32": round(library.peak_gmacs(bf16=False), 1),
            "bfloat16": round(library.peak_gmacs(bf16=True), 1) if library.channels_per_block("bfloat16") else None}
    return {"default_path": "ours", "amp_choice": {"path": "ours_bf16" if choice == "onednn-bf16" else "ours",
                                                   "note": note}, "peak_gmacs": peak}


def achieved_gmacs(report: Dict, path: str) -> Dict[str, float]:
    """Multiply-accumulates per second of `path`: training counts three forward passes per image."""
    from src.training.model_summary import TRAIN_PASSES
    gmacs, measured = report["model"]["gflops"], report[path]
    rates = {"train": gmacs * TRAIN_PASSES * measured["train_compute_img_per_s"]}
    rates.update({label: gmacs * measured[label]["img_per_s"] for label in measured if label.startswith("eval_batch_")})
    return {label: round(rate, 1) for label, rate in rates.items()}


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
    paths = [name for name in (*MINDSPORE_WORKERS, *TORCH_WORKERS) if name in report]
    for base in ("torch", "torch_cl"):
        for name in [name for name in paths if name != base and base in report]:
            ratios[f"train_{name}_over_{base}"] = round(
                report[name]["train_compute_img_per_s"] / report[base]["train_compute_img_per_s"], 3)
            for label in [k for k in ms_result if k.startswith("eval_batch_")]:
                ratios[f"{label}_{name}_over_{base}"] = round(
                    report[name][label]["img_per_s"] / report[base][label]["img_per_s"], 3)
    if "ours_bf16" in report and "torch_bf16" in report:  # bfloat16 beside bfloat16
        ratios["train_ours_bf16_over_torch_bf16"] = round(
            report["ours_bf16"]["train_compute_img_per_s"] / report["torch_bf16"]["train_compute_img_per_s"], 3)
        for label in [k for k in ms_result if k.startswith("eval_batch_")]:
            ratios[f"{label}_ours_bf16_over_torch_bf16"] = round(
                report["ours_bf16"][label]["img_per_s"] / report["torch_bf16"][label]["img_per_s"], 3)
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

    def row(label: str, ms_value, torch_value=None, ratio=None):
        torch_text = "" if torch_value is None else torch_value
        ratio_text = "" if ratio is None else ratio
        lines.append(f"  {label:<38}{ms_value:>22}{torch_text:>22}{ratio_text:>8}")

    for r in reports:
        ms_result, torch_result = r["mindspore"], r.get("torch")
        capped = "" if r.get("cpu_isa", "all") == "all" else f", oneDNN and PyTorch capped at {r['cpu_isa']}"
        lines.append(f"{r['net']} batch {r['batch_size']} @ {r['image_size']}px, {r['threads']} threads, "
                     f"{r['workers']} pipeline workers, on {r['cpu']}{capped}")
        lines += _cpu_path_rows(r)
        lines.append("  MindSpore's own CPU convolutions beside PyTorch eager NCHW: compile, latency, the input "
                     "pipelines")
        lines.append(f"  {'measure':<38}{'MindSpore convs':>22}{'PyTorch':>22}{'ratio':>8}")

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
        lines.append("  ratio: MindSpore convs / PyTorch; for the pipeline rows, pipeline img/s / MindSpore convs "
                     "training img/s")
        lines.append(model_line(r))
        lines += _breakdown_rows(r)
        if "onnxruntime" in r:
            lines += _deployment_rows(r)
        lines.append("")
    return "\n".join(lines)


def _cpu_path_rows(r: Dict) -> List[str]:
    """The headline: what train.py runs here first, then every other CPU path (train and eval img/s,
    ratios to PyTorch NCHW and channels_last, training GMAC/s against this CPU's peak)."""
    first = [r["default_path"]] + ([r["amp_choice"]["path"]] if r.get("amp_choice") else [])
    paths = list(dict.fromkeys(first + [name for name in (*MINDSPORE_WORKERS, *TORCH_WORKERS) if name in r]))
    paths = [name for name in paths if name in r]
    evals = [k for k in r["mindspore"] if k.startswith("eval_batch_")]
    peak = r.get("peak_gmacs") or {}
    lines = [f"  what train.py runs here: {LABELS[r['default_path']]}, float32 (amp_level auto is O0 on CPU)"]
    if r.get("amp_choice"):
        lines.append(f"  with --amp_level O2: {LABELS[r['amp_choice']['path']]}; {r['amp_choice']['note']}")
    if peak:
        lines.append("  this CPU's peak (a large oneDNN 1x1 convolution): " + ", ".join(
            f"{dtype} {rate} GMAC/s" for dtype, rate in peak.items() if rate))
    lines += [f"  {'path':<28}{'train img/s':>20}{'GMAC/s (% of peak)':>20}"
              + "".join(f"{label.replace('_', ' ') + ' img/s':>26}" for label in evals)]

    def of_peak(name: str) -> str:
        rate = r["gmacs_per_s"][name]["train"]
        dtype = "bfloat16" if name.endswith("bf16") else "float32"
        return f"{rate:.0f}" + (f" ({100 * rate / peak[dtype]:.0f}%)" if peak.get(dtype) else "")

    def cell(name: str, label: str, value: float) -> str:
        over = [r["ratios"].get(f"{label}_{name}_over_{base}") for base in ("torch", "torch_cl")]
        shown = "/".join(f"{x:.2f}" for x in over if x is not None)
        return f"{value:.2f}" + (f" ({shown}x)" if shown else "")

    for name in paths:
        lines.append(f"  {LABELS[name]:<28}{cell(name, 'train', r[name]['train_compute_img_per_s']):>20}"
                     f"{of_peak(name):>20}"
                     + "".join(f"{cell(name, label, r[name][label]['img_per_s']):>26}" for label in evals))
    lines.append("  x: over PyTorch NCHW / channels_last; GMAC/s: training, three forward passes per image")
    if "train_ours_bf16_over_torch_bf16" in r["ratios"]:
        lines.append(f"  {LABELS['ours_bf16']} over {LABELS['torch_bf16']}: " + ", ".join(
            f"{label.replace('_', ' ')} {r['ratios'][f'{label}_ours_bf16_over_torch_bf16']:.2f}x"
            for label in ["train", *evals]))
    return lines


def _breakdown_rows(r: Dict) -> List[str]:
    """Each MindSpore path's training step taken apart."""
    lines = []
    for name, parts in r.get("breakdown_ms", {}).items():
        lines.append(f"  one training step, {LABELS[name]}: " + ", ".join(f"{part} {value:.0f} ms"
                                                                         for part, value in parts.items()))
    return lines


def _deployment_rows(r: Dict) -> List[str]:
    """CPU inference paths side by side: MindSpore, PyTorch eager, the ONNX export under onnxruntime
    (float, and int8 where onnx is installed), with the speed-ups of the ONNX files."""
    paths = [name for name in ("mindspore", "torch", "onnxruntime", "onnxruntime_hostnorm", "onnxruntime_pixels",
                               "onnxruntime_int8") if name in r]
    titles = {"mindspore": "MindSpore", "torch": "PyTorch", "onnxruntime": "onnxruntime",
              "onnxruntime_int8": "ort int8", "onnxruntime_hostnorm": "ort+norm", "onnxruntime_pixels": "ort pixels"}
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
        lines.append("  ort int8: the same files quantized as export.py --quantize int8 does "
                     "(QDQ, per-channel weights)")
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
    parser.add_argument("--cpu_isa", choices=tuple(CPU_ISAS), default="all",
                        help="cap our oneDNN and PyTorch's at this instruction set, as a CPU without the ones above "
                             "it runs (e.g. avx2); MindSpore's own convolutions are capped at AVX2 always")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--compute_only", action="store_true",
                        help="training and evaluation on in-memory data only (no ONNX, pipeline or end-to-end rows)")
    parser.add_argument("--pipelines_only", action="store_true",
                        help="the input-pipeline comparison only (no network is built or timed)")
    parser.add_argument("--photos", type=positive_int, default=256,
                        help="generated photographs for the ImageNet pipeline comparison")
    parser.add_argument("--photo_batch", type=positive_int, default=32, help="batch size of the pipeline comparison")
    parser.add_argument("--ceiling_images", type=positive_int, default=2048,
                        help="16x16 JPEGs for the per-process ceiling of the pipelines")
    parser.add_argument("--worker", choices=(*MINDSPORE_WORKERS, *TORCH_WORKERS, "pipelines", "storage", *ONNX_WORKERS),
                        help=argparse.SUPPRESS)
    parser.add_argument("--breakdown", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--photo_dir", help=argparse.SUPPRESS)
    parser.add_argument("--cores", type=positive_int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--onnx_files", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compute_only and args.pipelines_only:
        parser.error("--compute_only and --pipelines_only leave nothing to measure together; give one of them")
    if not args.worker:  # the measuring processes get checked values; the torch one must not load MindSpore
        from src.device import available_cores, cap_workers
        from src.resnet import ARCHS
        if args.net not in ARCHS:
            parser.error(f"argument --net: invalid choice: '{args.net}' (choose from {', '.join(ARCHS)})")
        args.threads = args.threads or available_cores()
        args.workers, note = cap_workers(args.workers)
        if note:
            print(note.replace("num_parallel_workers", "--workers"), flush=True)
        if args.photo_batch > min(args.photos, args.ceiling_images):
            parser.error(f"argument --photo_batch: {args.photo_batch} is more than --photos {args.photos} or "
                         f"--ceiling_images {args.ceiling_images}; lower it or generate more images")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker == "pipelines":
        return serve_pipelines(args)
    if args.worker == "storage":
        return serve_storage(args)
    if args.worker:
        return serve(args)
    if args.vs_torch and importlib.util.find_spec("torch") is None:
        from src.migration.convert_torch import INSTALL_HINT
        raise UserInputError(f"--vs-torch needs PyTorch, which is not installed; {INSTALL_HINT}")
    configs = PRESETS[args.preset] if args.preset else [(args.net, args.batch_size, args.image_size)]
    reports = []
    with tempfile.TemporaryDirectory(prefix="benchmark-") as data_root:
        for net_name, batch, size in [] if args.pipelines_only else configs:
            reports.append(benchmark(net_name, batch, size, args, data_root))
        pipelines = None if args.compute_only else benchmark_pipelines(args, data_root)
    if reports:
        print(format_table(reports))
    if pipelines:
        print(format_pipeline_table(pipelines))
    if args.json:
        from src.files import write_atomic
        write_atomic(args.json, json.dumps({"reports": reports, "input_pipelines": pipelines}, indent=2) + "\n")
        print(f"report written to {args.json}")
    return 0


if __name__ == "__main__":
    run_cli(main)
