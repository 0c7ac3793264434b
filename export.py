"""Export a trained checkpoint for inference: MINDIR (default), ONNX, or AIR (Ascend only).

    python export.py --config_path CONFIG --checkpoint_file_path CKPT [--file_name NAME]
        [--file_format MINDIR|ONNX|AIR] [--batch_size N] [--width W --height H] [--verify] [--use_ema True]

The checkpoint may be this repository's or a model-zoo ResNet checkpoint (its names are mapped,
one log line says so); the zoo's `--ckpt_file` names it too. The network is the config's
net_name/class_num in inference mode (with the checkpoint's EMA weights under --use_ema True); the
input is float32 (batch, 3, height, width), normalized as in evaluation; height/width default to
eval_image_size.
The file NAME.mindir|.onnx|.air (default NAME: net_name) is written atomically.

--export_input_stage True exports the network with its input stage (src/data/input_stage.py) in
front: the file takes uint8 RGB pixels (batch, height, width, 3), as eval_image crops them, and
normalizes them inside the graph (4x fewer input bytes, no host normalization in the deployment).
Its --verify feeds seeded uint8 pixels to the file and the same pixels, normalized on the host, to
the checkpoint network. It does not combine with --quantize int8.

Batch dimension: MINDIR files have a dynamic batch (any size at run time) unless
--dynamic_batch False. ONNX and AIR files have a FIXED batch of --batch_size: feed exactly that
many images (predict.py pads the last batch), and export with --batch_size 1 for single images.

--verify reloads the written file (MINDIR through MindSpore's graph loader, ONNX through
onnxruntime) and compares its logits with the checkpoint network on a seeded random input
(numpy default_rng(0), standard normal); it prints the max abs difference and the top-1 agreement
and exits with code 1, writing no file, when the difference exceeds --verify_tolerance (1e-4).
The last line on stdout is one JSON object: path, file_format, input ("float32 NCHW" or
"uint8 NHWC"), input_shape (in that layout; null batch: dynamic), verified, max_abs_diff,
top1_agreement, max_abs_logit, tolerance, quantization.

--quantize int8 (ONNX only; needs onnx and onnxruntime) writes the int8 model instead of the float
one (default NAME: net_name_int8): onnxruntime's static quantization, QDQ format, int8 weights per
output channel, uint8 activations whose ranges are calibrated (--calibration_method minmax, entropy
or percentile) on --calibration_samples (512) training images of --calibration_data (a dataset
folder, as data_path), in the seeded order of a first training epoch, through the evaluation
transform (eval_image_size, eval_resize_size, as eval.py). With --verify the float export is
checked as above, then the int8 model's top-1 agreement with it and the largest logit difference
on the calibration images are reported ("quantization" in the JSON line). Evaluate the written
file with eval.py --model_file.
"""
import itertools
import json
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import mindspore as ms
import numpy as np

from src.config import Config, load_config
from src.data.host_stage import Normalization, host_normalize, normalization_of
from src.data.input_stage import WithInputStage
from src.dataset import create_dataset
from src.deploy.inference import ExportedModel, compare_logits, require_onnxruntime, seeded_input, seeded_pixels
from src.deploy.quantize import (
    CALIBRATION_METHODS,
    compare_exports,
    quantize_onnx,
    quantized_convolutions,
    require_quantization,
)
from src.device import init_device
from src.errors import UserInputError, run_cli
from src.resnet import create_model
from src.training.checkpoint import load_into_network

FILE_FORMATS = {"MINDIR": ".mindir", "ONNX": ".onnx", "AIR": ".air"}
DYNAMIC_FORMATS = ("MINDIR",)  # MindSpore 2.10 refuses a dynamic shape for ONNX; AIR is fixed too
MAX_DYNAMIC_VERIFY_BATCH = 8


def input_layout(batch_size: Optional[int], height: int, width: int, pixels: bool) -> List[Optional[int]]:
    """The exported input's shape: uint8 (batch, H, W, 3) with the input stage, else float32 (batch, 3, H, W)."""
    return [batch_size, height, width, 3] if pixels else [batch_size, 3, height, width]


def export_network(net, *, file_name: str, file_format: str, batch_size: Optional[int], height: int,
                   width: int, staging: str, pixels: bool = False) -> str:
    """Export `net` for an input of float32 (batch_size, 3, height, width), or of uint8
    (batch_size, height, width, 3) when `pixels` (a network with the input stage), into the folder
    `staging`; batch_size None exports a dynamic batch. Returns the staged file's path."""
    shape = input_layout(batch_size, height, width, pixels)
    dtype = ms.uint8 if pixels else ms.float32
    if batch_size is None:
        example = ms.Tensor(shape=shape, dtype=dtype)
    else:
        example = ms.Tensor(np.zeros(shape, ms.dtype_to_nptype(dtype)))
    staged = os.path.join(staging, os.path.basename(file_name))
    ms.export(net, example, file_name=staged, file_format=file_format)
    return staged + FILE_FORMATS[file_format]


def verify_export(net, path: str, *, batch_sizes: Sequence[int], height: int, width: int,
                  normalization: Optional[Normalization] = None) -> Dict[str, float]:
    """Run the exported file and the checkpoint network `net` (float input) on the same seeded
    inputs (one per batch size) and compare their logits over all samples. With `normalization`
    the file takes pixels: it gets seeded uint8 pixels, `net` the same pixels normalized on the host."""
    model = ExportedModel(path)
    references: List[np.ndarray] = []
    outputs: List[np.ndarray] = []
    for batch in batch_sizes:
        if normalization is None:
            inputs = seeded_input(batch, height, width, seed=0)
            references.append(net(ms.Tensor(inputs)).asnumpy())
        else:
            inputs = seeded_pixels(batch, height, width, seed=0)
            references.append(net(ms.Tensor(host_normalize(inputs, normalization))).asnumpy())
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


def check_quantize(cfg: Config, file_format: str, height: int, width: int) -> bool:
    """Whether to quantize; every unusable request fails here, before any work."""
    quantize = str(cfg.quantize).lower()
    if quantize == "none":
        return False
    if quantize != "int8":
        raise UserInputError(f"unknown --quantize '{cfg.quantize}'; choose none or int8")
    if cfg.export_input_stage:  # its calibration and int8 verification speak float NCHW only
        raise UserInputError("--quantize int8 does not combine with --export_input_stage True; quantize "
                             "the float-input export (--export_input_stage False)")
    if file_format != "ONNX":
        raise UserInputError(f"--quantize int8 needs --file_format ONNX (onnxruntime quantizes ONNX files), "
                             f"got {file_format}")
    if not cfg.calibration_data:
        raise UserInputError("--quantize int8 needs --calibration_data PATH: the dataset folder (as data_path) "
                             "whose training images calibrate the activation ranges")
    if not os.path.isdir(cfg.calibration_data):
        raise UserInputError(f"calibration data folder not found: {cfg.calibration_data}; pass --calibration_data "
                             f"with the dataset folder (as data_path) whose training images calibrate the activations")
    if cfg.calibration_samples < 1:
        raise UserInputError(f"--calibration_samples must be a positive integer, got {cfg.calibration_samples}")
    if cfg.calibration_method not in CALIBRATION_METHODS:
        raise UserInputError(f"unknown --calibration_method '{cfg.calibration_method}'; choose one of "
                             f"{', '.join(CALIBRATION_METHODS)}")
    if height != width:
        raise UserInputError(f"--quantize int8 calibrates on square images (the eval transform); "
                             f"export with equal --height and --width, got {height}x{width}")
    require_quantization()
    return True


@dataclass
class Calibration:
    """The calibration images, read once: uint8 NHWC batches and the dataset's normalization."""
    pixels: List[np.ndarray]
    normalization: Normalization

    def batches(self) -> Iterator[np.ndarray]:
        """The batches as the float model takes them (normalized float32 NCHW), one at a time."""
        return (host_normalize(images, self.normalization) for images in self.pixels)

    @property
    def samples(self) -> int:
        return sum(len(images) for images in self.pixels)


def calibration_batches(cfg: Config, *, batch_size: int, image_size: int) -> Calibration:
    """Training images of --calibration_data in the seeded order of a first training epoch (so the
    choice is a function of the seed), through eval.py's transform, in whole batches: read (and
    decoded) here, once, so bad data fails before the export."""
    try:
        data = create_dataset(cfg.dataset, cfg.calibration_data, training=True, augment=False,
                              batch_size=batch_size, image_size=image_size, class_num=cfg.class_num,
                              num_parallel_workers=cfg.num_parallel_workers, seed=cfg.seed,
                              interpolation=cfg.interpolation, resize_size=cfg.eval_resize_size)
        num_batches = min(math.ceil(cfg.calibration_samples / batch_size), data.get_dataset_size())
        rows = data.create_tuple_iterator(output_numpy=True, num_epochs=1)
        pixels = [images for images, _ in itertools.islice(rows, num_batches)]
    except UserInputError as err:  # the dataset's message speaks of data_path
        raise UserInputError(f"--calibration_data: {err}") from None
    return Calibration(pixels, data.normalization)


def quantize_export(float_path: str, cfg: Config, *, calibration: Calibration, staging: str) -> Tuple[str, Dict]:
    """The int8 model of the staged float ONNX file and its report. The int8 file and onnxruntime's
    intermediate files go to a folder of their own, so no --file_name can make them overwrite the
    float file they are compared with."""
    workdir = os.path.join(staging, "int8")
    os.makedirs(workdir)
    int8_path = os.path.join(workdir, "int8.onnx")
    quantize_onnx(float_path, int8_path, calibration.batches(), num_batches=len(calibration.pixels),
                  method=cfg.calibration_method, workdir=workdir)
    report = {"calibration_method": cfg.calibration_method, "calibration_data": cfg.calibration_data,
              "calibration_samples": calibration.samples, **quantized_convolutions(int8_path),
              "top1_agreement": None, "max_abs_diff": None}
    print(f"quantized {report['quantized']} of {report['convolutions']} convolutions to int8 (QDQ, per-channel "
          f"weights), activations calibrated ({cfg.calibration_method}) on {report['calibration_samples']} "
          f"training images of {cfg.calibration_data}", flush=True)
    if cfg.verify:
        result = compare_exports(float_path, int8_path, calibration.batches())
        report.update(top1_agreement=result["top1_agreement"], max_abs_diff=result["max_abs_diff"])
        print(f"verify int8: top-1 agreement with the float model "
              f"{round(result['top1_agreement'] * result['samples'])}/{result['samples']} on the calibration "
              f"images, largest logit difference {result['max_abs_diff']:.3g} (float logits reach "
              f"{result['max_abs_logit']:.3g})", flush=True)
    return int8_path, report


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
    calibration = None
    if check_quantize(cfg, file_format, height, width):
        calibration = calibration_batches(cfg, batch_size=cfg.batch_size, image_size=height)

    init_device(cfg.device_target, device_id=cfg.device_id, mode_name="GRAPH")
    net = create_model(cfg.net_name, num_classes=cfg.class_num)
    load_into_network(net, cfg.checkpoint_file_path, what=f"{cfg.net_name} with class_num {cfg.class_num}",
                      use_ema=cfg.use_ema)
    net.set_train(False)

    file_name = cfg.file_name or (f"{cfg.net_name}_int8" if calibration else cfg.net_name)
    if file_name.lower().endswith(FILE_FORMATS[file_format]):  # --file_name model.onnx means model + .onnx
        file_name = file_name[:-len(FILE_FORMATS[file_format])]
    target = os.path.abspath(file_name + FILE_FORMATS[file_format])
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    pixels = bool(cfg.export_input_stage)
    normalization = normalization_of(cfg.dataset) if pixels else None
    exported = WithInputStage(net, normalization) if pixels else net
    exported.set_train(False)
    report = {"path": target, "file_format": file_format, "input": "uint8 NHWC" if pixels else "float32 NCHW",
              "input_shape": input_layout(batch_size, height, width, pixels), "verified": False,
              "max_abs_diff": None, "top1_agreement": None, "max_abs_logit": None,
              "tolerance": cfg.verify_tolerance if cfg.verify else None, "quantization": None}
    dims = ["dynamic" if dynamic else batch_size] + report["input_shape"][1:]
    shape_text = f"{report['input']} ({', '.join(map(str, dims))})"
    with tempfile.TemporaryDirectory(dir=folder, prefix=".export-") as staging:
        staged = export_network(exported, file_name=file_name, file_format=file_format, batch_size=batch_size,
                                height=height, width=width, staging=staging, pixels=pixels)
        if cfg.verify:
            batches = [cfg.batch_size] if not dynamic else \
                sorted({min(cfg.batch_size, MAX_DYNAMIC_VERIFY_BATCH), 1}, reverse=True)
            result = verify_export(net, staged, batch_sizes=batches, height=height, width=width,
                                   normalization=normalization)
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
        if calibration:
            staged, report["quantization"] = quantize_export(staged, cfg, calibration=calibration, staging=staging)
        os.replace(staged, target)
    print(f"exported {file_format}{' int8' if calibration else ''} with input {shape_text} to {target}", flush=True)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    run_cli(main)
