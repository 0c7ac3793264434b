"""Export a trained checkpoint for inference: MINDIR (default), ONNX, or AIR (Ascend only).

    python export.py --config_path CONFIG --checkpoint_file_path CKPT [--file_name NAME]
        [--file_format MINDIR|ONNX|AIR] [--batch_size N] [--width W --height H] [--verify] [--use_ema True]

The checkpoint may be this repository's or a model-zoo ResNet checkpoint (its names are mapped,
one log line says so); the zoo's `--ckpt_file` names it too. The network is the config's
net_name/class_num in inference mode (with the checkpoint's EMA weights under --use_ema True); the
input is float32 (batch, 3, height, width), normalized as in evaluation; height/width default to
eval_image_size.
The file NAME.mindir|.onnx|.air (default NAME: net_name) is written atomically.

Batch dimension: MINDIR files have a dynamic batch (any size at run time) unless
--dynamic_batch False. ONNX and AIR files have a FIXED batch of --batch_size: feed exactly that
many images (predict.py pads the last batch), and export with --batch_size 1 for single images.

--verify reloads the written file (MINDIR through MindSpore's graph loader, ONNX through
onnxruntime) and compares its logits with the checkpoint network on a seeded random input
(numpy default_rng(0), standard normal); it prints the max abs difference and the top-1 agreement
and exits with code 1, writing no file, when the difference exceeds --verify_tolerance (1e-4).
The last line on stdout is one JSON object: path, file_format, input_shape (null batch: dynamic),
verified, max_abs_diff, top1_agreement, max_abs_logit, tolerance.
"""
import json
import os
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

import numpy as np
import mindspore as ms

from src.config import Config, load_config
from src.deploy.inference import ExportedModel, compare_logits, require_onnxruntime, seeded_input
from src.device import init_device
from src.errors import UserInputError, run_cli
from src.resnet import create_model
from src.training.checkpoint import load_into_network

FILE_FORMATS = {"MINDIR": ".mindir", "ONNX": ".onnx", "AIR": ".air"}
DYNAMIC_FORMATS = ("MINDIR",)  # MindSpore 2.10 refuses a dynamic shape for ONNX; AIR is fixed too
MAX_DYNAMIC_VERIFY_BATCH = 8


def export_network(net, *, file_name: str, file_format: str, batch_size: Optional[int], height: int,
                   width: int, staging: str) -> str:
    """Export `net` for an input of (batch_size, 3, height, width) into the folder `staging`;
    batch_size None exports a dynamic batch. Returns the staged file's path."""
    if batch_size is None:
        example = ms.Tensor(shape=[None, 3, height, width], dtype=ms.float32)
    else:
        example = ms.Tensor(np.zeros((batch_size, 3, height, width), np.float32))
    staged = os.path.join(staging, os.path.basename(file_name))
    ms.export(net, example, file_name=staged, file_format=file_format)
    return staged + FILE_FORMATS[file_format]


def verify_export(net, path: str, *, batch_sizes: Sequence[int], height: int, width: int) -> Dict[str, float]:
    """Run the exported file and the checkpoint network on the same seeded inputs (one per batch
    size) and compare their logits over all samples."""
    model = ExportedModel(path)
    references: List[np.ndarray] = []
    outputs: List[np.ndarray] = []
    for batch in batch_sizes:
        inputs = seeded_input(batch, height, width, seed=0)
        references.append(net(ms.Tensor(inputs)).asnumpy())
        outputs.append(model.run(inputs))
    return compare_logits(np.concatenate(references), np.concatenate(outputs))


def check_format(cfg: Config) -> str:
    """The normalized file format; AIR off Ascend and unverifiable requests fail before any work."""
    file_format = str(cfg.file_format).upper()
    if file_format not in FILE_FORMATS:
        raise UserInputError(f"unknown file_format '{cfg.file_format}'; choose one of {', '.join(FILE_FORMATS)}")
    if file_format == "AIR" and cfg.device_target != "Ascend":
        raise UserInputError("AIR export needs an Ascend device (--device_target Ascend); "
                             "use --file_format MINDIR or ONNX here")
    if cfg.verify and file_format == "AIR":
        raise UserInputError("--verify cannot reload AIR files (only Ascend's ATC reads them); verify a "
                             "MINDIR export of the same checkpoint, or export without --verify")
    if cfg.verify and file_format == "ONNX":
        require_onnxruntime()
    return file_format


def check_sizes(cfg: Config) -> None:
    for key in ("batch_size", "height", "width"):
        value = getattr(cfg, key)
        if value < 0 or (key == "batch_size" and value == 0):
            raise UserInputError(f"--{key} must be a positive integer, got {value}")
    if cfg.verify_tolerance < 0:
        raise UserInputError(f"--verify_tolerance must be >= 0, got {cfg.verify_tolerance}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(__doc__)
    cfg = load_config(args, prog="export.py")
    for note in cfg.notes:
        print(note, flush=True)
    if not cfg.checkpoint_file_path:
        raise UserInputError("no checkpoint given; pass --checkpoint_file_path path/to/model.ckpt")
    file_format = check_format(cfg)
    check_sizes(cfg)
    height, width = cfg.height or cfg.eval_image_size, cfg.width or cfg.eval_image_size
    dynamic = cfg.dynamic_batch and file_format in DYNAMIC_FORMATS
    batch_size = None if dynamic else cfg.batch_size

    init_device(cfg.device_target, device_id=cfg.device_id, mode_name="GRAPH")
    net = create_model(cfg.net_name, num_classes=cfg.class_num)
    load_into_network(net, cfg.checkpoint_file_path, what=f"{cfg.net_name} with class_num {cfg.class_num}",
                      use_ema=cfg.use_ema)
    net.set_train(False)

    file_name = cfg.file_name or cfg.net_name
    if file_name.lower().endswith(FILE_FORMATS[file_format]):  # --file_name model.onnx means model + .onnx
        file_name = file_name[:-len(FILE_FORMATS[file_format])]
    target = os.path.abspath(file_name + FILE_FORMATS[file_format])
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    report = {"path": target, "file_format": file_format, "input_shape": [batch_size, 3, height, width],
              "verified": False, "max_abs_diff": None, "top1_agreement": None, "max_abs_logit": None,
              "tolerance": cfg.verify_tolerance if cfg.verify else None}
    shape_text = f"({'dynamic' if dynamic else batch_size}, 3, {height}, {width})"
    with tempfile.TemporaryDirectory(dir=folder, prefix=".export-") as staging:
        staged = export_network(net, file_name=file_name, file_format=file_format, batch_size=batch_size,
                                height=height, width=width, staging=staging)
        if cfg.verify:
            batches = [cfg.batch_size] if not dynamic else \
                sorted({min(cfg.batch_size, MAX_DYNAMIC_VERIFY_BATCH), 1}, reverse=True)
            result = verify_export(net, staged, batch_sizes=batches, height=height, width=width)
            report.update(result)
            samples = sum(batches)
            print(f"verify: {file_format} file vs checkpoint network on seeded inputs of batch "
                  f"{' and '.join(map(str, batches))}: max abs difference {result['max_abs_diff']:.3g}, "
                  f"top-1 agreement {round(result['top1_agreement'] * samples)}/{samples} "
                  f"(tolerance {cfg.verify_tolerance:g})", flush=True)
            if not result["max_abs_diff"] <= cfg.verify_tolerance:
                print(json.dumps({**report, "path": None}), flush=True)
                print(f"error: the exported {file_format} differs from the checkpoint network by "
                      f"{result['max_abs_diff']:.3g} (> tolerance {cfg.verify_tolerance:g}; its logits reach "
                      f"{result['max_abs_logit']:.3g}); not written to {target}", file=sys.stderr, flush=True)
                return 1
            report["verified"] = True
        os.replace(staged, target)
    print(f"exported {file_format} with input {shape_text} to {target}", flush=True)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    run_cli(main)
