"""One (net, batch, size) configuration measured: its paths' processes alternating repeat by repeat,
the ONNX files, the real pipeline, the training step's breakdown, and the ratios between them."""
import argparse
import importlib.util
import json
import os
from typing import Dict, List

from src.cpu import cpu_model
from tools.benchmarking.capacity import achieved_gmacs, cpu_capacity, model_figures
from tools.benchmarking.cpu_paths import MINDSPORE_WORKERS, TORCH_WORKERS, compute_paths
from tools.benchmarking.end_to_end import write_data
from tools.benchmarking.onnx_runner import int8_files
from tools.benchmarking.timing import median_of
from tools.benchmarking.worker import Worker, progress


def benchmark_configuration(net_name: str, batch: int, size: int, args: argparse.Namespace, data_root: str) -> Dict:
    """All measurements for one configuration; MindSpore and PyTorch alternate repeat by repeat,
    each in its own process."""
    report = {"net": net_name, "batch_size": batch, "image_size": size, "threads": args.threads,
              "workers": args.workers, "cpu_isa": args.cpu_isa,
              **cpu_capacity(net_name, batch, size, args.threads, args.cpu_isa)}
    workers = []
    what = f"{net_name} {batch}x{size}"
    try:
        for framework in compute_paths(args.vs_torch, cpu_isa=args.cpu_isa):
            progress(f"{what}: starting the {framework} process (its first step compiles)")
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
        for repeat in range(args.repeats):
            for worker in workers:
                progress(f"{what}: measuring {worker.framework}, repeat {repeat + 1} of {args.repeats}")
                rounds[worker.framework].append(worker.ask("measure"))
        for worker in workers:
            report[worker.framework] = {**worker.first, **median_of(rounds[worker.framework])}
        data = {"pipeline_img_per_s": {}, "train_end_to_end_img_per_s": {}}
        if not args.compute_only:
            progress(f"{what}: training end to end through the input pipelines")
            paths = write_data(os.path.join(data_root, f"{net_name}_{size}"), size,
                               images=(max(4, args.steps) + 2) * batch)
            data = workers[0].ask("data " + json.dumps(paths))
        report["breakdown_ms"], report["convolution_passes"] = {}, {}
        report["own_loops_ms"], report["rest_of_step_ms"] = {}, {}
        for worker in [worker for worker in workers if worker.framework in MINDSPORE_WORKERS]:
            # in its measuring process, after every measurement: the profiles slow what they watch
            progress(f"{what}: one training step of {worker.framework} taken apart")
            taken_apart = worker.ask("breakdown")
            report["breakdown_ms"][worker.framework] = taken_apart["kinds"]
            report["convolution_passes"][worker.framework] = taken_apart["passes"]
            report["own_loops_ms"][worker.framework] = taken_apart["own"]
            report["rest_of_step_ms"][worker.framework] = taken_apart["rest"]
    finally:
        for worker in workers:
            worker.close()
    report["cpu"] = cpu_model()
    report["pipeline_img_per_s"] = data["pipeline_img_per_s"]
    report["mindspore"]["train_end_to_end_img_per_s"] = data["train_end_to_end_img_per_s"]
    report["ratios"] = _ratios(report)
    report["model"] = model_figures(report)
    report["gmacs_per_s"] = {path: achieved_gmacs(report, path) for path in (*MINDSPORE_WORKERS, *TORCH_WORKERS)
                             if path in report}
    return report


def _ratios(report: Dict) -> Dict[str, float]:
    """Pipelines over training, every path over PyTorch NCHW and channels_last, bfloat16 over
    bfloat16, and the ONNX files over the frameworks and each other."""
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

