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
import gc

gc.disable()  # while the modules load; run_cli collects again (src/errors.py)

import argparse
import importlib.util
import json
import tempfile
from typing import Optional, Sequence

from src.errors import OneLineParser, UserInputError, run_cli
from tools.benchmarking.configurations import benchmark_configuration
from tools.benchmarking.cpu_paths import CPU_ISAS, MINDSPORE_WORKERS, ONNX_WORKERS, TORCH_WORKERS
from tools.benchmarking.pipeline_comparison import benchmark_pipelines
from tools.benchmarking.pipelines import serve_pipelines
from tools.benchmarking.serve import serve
from tools.benchmarking.storage import serve_storage
from tools.benchmarking.tables import format_pipeline_table, format_table

PRESETS = {"targets": [("resnet50", 8, 224), ("resnet18", 64, 32)]}


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
    parser.add_argument("--breakdown", choices=("onednn", "operators"), help=argparse.SUPPRESS)
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
            reports.append(benchmark_configuration(net_name, batch, size, args, data_root))
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
