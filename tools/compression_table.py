"""docs/compression.md's table: ResNet18 float, quantization-aware (QAT: SimQAT and LSQ), pruned (by L1
norm and by SCOP's knockoff scores) and ONNX int8 side by side on one dataset, each made by the
commands a user runs (train.py, eval.py, export.py):

    python tools/compression_table.py --dataset sample     # the demo's sample data (3,000 + 500 images)
    python tools/compression_table.py --dataset digits     # scikit-learn's handwritten digits (1,297 + 500)

The float network trains from scratch (the demo's recipe; 10 epochs at lr 0.02 on the digits, as
tools/benchmark_learning.py); QAT, LSQ and both prunings fine-tune its last checkpoint with the recipes of
docs/compression.md; the int8 ONNX file is export.py's post-training quantization of the float
checkpoint. For each: held-out top-1 (eval.py), the checkpoint's and the exported file's size,
parameters and GFLOPs, CPU latency at batch 1 and 32 (median of timed calls in a process of its own,
our CPU layers where the run would use them; onnxruntime for the ONNX file) and the training time
(the train.py process, start to end). The last stdout line is one JSON object; --json writes it too.
"""
import argparse
import functools
import glob
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "config", "sample_resnet18.yaml")
NET = "resnet18"
IMAGE_SIZE = 32
LATENCY_BATCHES = (1, 32)
FLOAT_RECIPES = {"sample": [], "digits": ["--epoch_size", "10", "--lr_max", "0.02"]}
# docs/compression.md's fine-tuning commands
QAT_RECIPE = ["--compression", "qat", "--epoch_size", "2", "--warmup_epochs", "0", "--lr_decay_mode", "cosine",
              "--lr_init", "0.01", "--lr_max", "0.01", "--lr_end", "0.0001"]
LSQ_RECIPE = ["--compression", "lsq", *QAT_RECIPE[2:]]  # QAT's schedule, learned step sizes
PRUNE_RECIPE = ["--compression", "prune", "--prune_ratio", "0.5", "--epoch_size", "3", "--warmup_epochs", "0",
                "--lr_decay_mode", "cosine", "--lr_init", "0.01", "--lr_max", "0.01", "--lr_end", "0.0001"]
# the same, its channels chosen by SCOP's scores after one epoch of the knockoff stage
SCOP_RECIPE = [*PRUNE_RECIPE, "--prune_criterion", "scop", "--knockoff_epochs", "1"]


def _run(command: List[str], log_path: str) -> float:
    """Run `command` in the repository with its output in `log_path`; the seconds it took. A failure
    names the command and the log's last lines."""
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        with open(log_path, encoding="utf-8") as log:
            tail = "".join(log.readlines()[-5:])
        raise SystemExit(f"error: {' '.join(command)} failed (exit {done.returncode}); see {log_path}:\n{tail}")
    return round(time.perf_counter() - start, 1)


def _last_json(log_path: str) -> Dict:
    with open(log_path, encoding="utf-8") as log:
        return json.loads([line for line in log if line.startswith("{")][-1])


def make_data(dataset: str, folder: str) -> str:
    """The dataset's CIFAR-10 binary folder, written under `folder` unless it is there."""
    if dataset == "sample":
        target = os.path.join(folder, "sample")
        if not os.path.exists(os.path.join(target, "cifar10", "test_batch.bin")):
            _run([sys.executable, "-m", "src.data.sample_data", target, "--formats", "cifar10"],
                 os.path.join(folder, "data.log"))
        return os.path.join(target, "cifar10")
    target = os.path.join(folder, "digits")
    if not os.path.exists(os.path.join(target, "test_batch.bin")):
        _run([sys.executable, "-m", "src.data.digits_data", target], os.path.join(folder, "data.log"))
    return target


def train(data_path: str, output_dir: str, extra: Sequence[str]) -> Dict:
    """train.py on the data with `extra` keys; its last checkpoint and the seconds the run took."""
    seconds = _run([sys.executable, "train.py", "--config_path", CONFIG, "--data_path", data_path,
                    "--output_dir", output_dir, *extra], output_dir + ".log")
    checkpoints = glob.glob(os.path.join(output_dir, NET, "cifar10", f"{NET}-*.ckpt"))
    return {"checkpoint": max(checkpoints, key=os.path.getmtime), "train_seconds": seconds}


def evaluate(data_path: str, log_path: str, source: Sequence[str]) -> Dict:
    """eval.py's held-out top-1 (`source`: the checkpoint's or the exported file's arguments)."""
    _run([sys.executable, "eval.py", "--config_path", CONFIG, "--data_path", data_path, *source], log_path)
    return {"top_1": _last_json(log_path)["top_1_accuracy"]}


def export(checkpoint: str, folder: str, name: str, extra: Sequence[str]) -> str:
    """export.py's file of `checkpoint`, written into `folder`."""
    _run([sys.executable, "export.py", "--config_path", CONFIG, "--checkpoint_file_path", checkpoint,
          "--file_name", os.path.join(folder, name), *extra], os.path.join(folder, f"export_{name}.log"))
    return max(glob.glob(os.path.join(folder, f"{name}.*")), key=os.path.getmtime)


def latency(sources: Sequence[str], compression: str, log_path: str) -> Dict:
    """Median batch-1 and batch-32 latency (ms) of a checkpoint, or of ONNX files (one per batch: their
    batch is fixed), in a process of its own."""
    _run([sys.executable, os.path.abspath(__file__), "--latency_of", *sources, "--compression", compression],
         log_path)
    return _last_json(log_path)


def measure_latency(sources: Sequence[str], compression: str, calls: int = 50) -> Dict:
    """The latency worker: ONNX files under onnxruntime, each at its own batch; or a checkpoint, as the
    network eval.py builds (its convolutions chosen as eval.py chooses them, weights frozen), at
    batches 1 and 32."""
    import numpy as np

    from src.openmp import set_openmp_environment
    set_openmp_environment()  # before MindSpore is imported
    from tools.benchmarking.timing import latency as timed
    rng = np.random.default_rng(0)

    def images(batch: int):
        return rng.random((batch, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)

    figures: Dict = {}
    if sources[0].endswith(".onnx"):
        from src.deploy.inference import onnx_session
        for path in sources:
            session = onnx_session(path)
            feed = session.get_inputs()[0]
            batch = int(feed.shape[0])
            inputs = {feed.name: images(batch)}
            session.run(None, inputs)
            run = functools.partial(session.run, None, inputs)
            figures[f"batch_{batch}_ms"] = timed(run, batch, calls)["latency_ms"]["p50"]
        return {"convolutions": "onnxruntime", **figures}
    import mindspore as ms

    from src.compression import compression_convolutions
    from src.cpu_layers import weights_frozen
    from src.runtime import set_up_runtime
    from src.training.checkpoint import network_from_checkpoint
    cpu_convolution, _ = compression_convolutions(compression, "auto", "CPU")
    convolutions = set_up_runtime("CPU", cpu_convolution=cpu_convolution, mode_name="GRAPH").convolutions
    net = network_from_checkpoint(NET, 10, sources[0], convolutions=convolutions, compression=compression,
                                  log=lambda line: None)
    net.set_train(False)

    def forward(tensor) -> None:
        net(tensor).asnumpy()
    with weights_frozen(net):
        for batch in LATENCY_BATCHES:
            tensor = ms.Tensor(images(batch))
            forward(tensor)  # compiles
            figures[f"batch_{batch}_ms"] = timed(functools.partial(forward, tensor), batch, calls)["latency_ms"]["p50"]
    return {"convolutions": convolutions, **figures}


def summary(checkpoint: str, compression: str) -> Dict:
    """Parameters and GFLOPs at 32 px of the checkpoint's network (in this process: no device needed)."""
    from src.evaluation.model_summary import model_summary
    from src.training.checkpoint import network_from_checkpoint
    net = network_from_checkpoint(NET, 10, checkpoint, compression=compression, log=lambda line: None)
    figures = model_summary(net, image_size=IMAGE_SIZE)
    return {"parameters_m": round(figures["parameters"] / 1e6, 2), "gflops": round(figures["gflops"], 3)}


def megabytes(path: str) -> float:
    return round(os.path.getsize(path) / 1e6, 2)


def table(dataset: str, folder: str) -> Dict[str, Dict]:
    """Every row of the table for `dataset`, its runs under `folder`."""
    data_path = make_data(dataset, folder)
    rows: Dict[str, Dict] = {}
    float_run = train(data_path, os.path.join(folder, "float"), FLOAT_RECIPES[dataset])
    base = float_run["checkpoint"]
    runs = {"float": ("none", float_run),
            "qat": ("qat", train(data_path, os.path.join(folder, "qat"), QAT_RECIPE + ["--pre_trained", base])),
            "lsq": ("lsq", train(data_path, os.path.join(folder, "lsq"), LSQ_RECIPE + ["--pre_trained", base])),
            "pruned": ("prune", train(data_path, os.path.join(folder, "pruned"),
                                      PRUNE_RECIPE + ["--pre_trained", base])),
            "pruned_scop": ("prune", train(data_path, os.path.join(folder, "pruned_scop"),
                                           SCOP_RECIPE + ["--pre_trained", base]))}
    for name, (compression, run) in runs.items():
        checkpoint = run["checkpoint"]
        exported = export(checkpoint, folder, name, ["--compression", compression, "--file_format", "MINDIR"])
        rows[name] = {**evaluate(data_path, os.path.join(folder, f"eval_{name}.log"),
                                 ["--checkpoint_file_path", checkpoint, "--compression", compression]),
                      "checkpoint_mb": megabytes(checkpoint), "exported": os.path.basename(exported),
                      "exported_mb": megabytes(exported), **summary(checkpoint, compression),
                      **latency([checkpoint], compression, os.path.join(folder, f"latency_{name}.log")),
                      "train_seconds": run["train_seconds"], "trained_from": "scratch" if name == "float" else "float"}
    start = time.perf_counter()
    int8 = {batch: export(base, folder, f"onnx_int8_b{batch}", ["--file_format", "ONNX", "--quantize", "int8",
                                                                 "--calibration_data", data_path,
                                                                 "--batch_size", str(batch)])
            for batch in LATENCY_BATCHES}
    seconds = round(time.perf_counter() - start, 1)
    largest = int8[LATENCY_BATCHES[-1]]
    rows["onnx_int8"] = {**evaluate(data_path, os.path.join(folder, "eval_onnx_int8.log"), ["--model_file", largest]),
                         "checkpoint_mb": None, "exported": os.path.basename(largest),
                         "exported_mb": megabytes(largest),
                         "parameters_m": rows["float"]["parameters_m"], "gflops": rows["float"]["gflops"],
                         **latency(list(int8.values()), "none", os.path.join(folder, "latency_onnx_int8.log")),
                         "train_seconds": seconds, "trained_from": "float (calibration, 2 files)"}
    return rows


def markdown(dataset: str, rows: Dict[str, Dict]) -> str:
    """The rows as docs/compression.md's table."""
    lines = [f"| ResNet18, {dataset} | top-1 | parameters (M) | GFLOPs | checkpoint MB | exported file MB | "
             f"batch 1 ms | batch 32 ms | training s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in rows.items():
        checkpoint = "-" if row["checkpoint_mb"] is None else f"{row['checkpoint_mb']:.1f}"
        lines.append(f"| {name} | {row['top_1']:.4f} | {row['parameters_m']:.2f} | {row['gflops']:.3f} | "
                     f"{checkpoint} | "
                     f"{row['exported_mb']:.1f} ({row['exported']}) | {row['batch_1_ms']:.2f} | "
                     f"{row['batch_32_ms']:.2f} | {row['train_seconds']:.0f} ({row['trained_from']}) |")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=sorted(FLOAT_RECIPES), default="sample")
    parser.add_argument("--output_dir", default="output/compression_table", help="runs, logs and files")
    parser.add_argument("--json", default="", help="also write the JSON object here")
    parser.add_argument("--latency_of", nargs="+", default=[], help=argparse.SUPPRESS)  # the latency worker
    parser.add_argument("--compression", default="none", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.latency_of:
        print(json.dumps(measure_latency(args.latency_of, args.compression)), flush=True)
        return 0
    folder = os.path.abspath(os.path.join(args.output_dir, args.dataset, time.strftime("%Y%m%d_%H%M%S")))
    os.makedirs(folder)
    rows = table(args.dataset, folder)
    print(markdown(args.dataset, rows), flush=True)
    result = json.dumps({"dataset": args.dataset, "folder": folder, "rows": rows})
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            handle.write(result + "\n")
    print(result, flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
