"""Export a network for inference: the file formats, the float and int8 exports and their checks
(export.py composes them; the benchmark exports its networks with export_network)."""
import itertools
import math
import os
from dataclasses import dataclass
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import mindspore as ms
import numpy as np

from src.compression import QUANTIZATIONS, check_compression
from src.config import Config
from src.cpu import cpu_flags, is_x86
from src.data.host_stage import Normalization, host_normalize
from src.dataset import create_dataset
from src.deploy.inference import ExportedModel, compare_logits, require_onnxruntime, seeded_input, seeded_pixels
from src.deploy.quantize import (
    CALIBRATION_METHODS,
    compare_exports,
    quantize_onnx,
    quantized_convolutions,
    reduces_range,
    require_quantization,
)
from src.errors import UserInputError

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
    int8_weights_reduced(cfg.int8_target)
    require_quantization()
    return True


def int8_weights_reduced(int8_target: str) -> bool:
    """Whether the int8 file's weights take 7 bits, for `int8_target` on this CPU (quantize.py)."""
    return reduces_range(int8_target, x86=is_x86(), flags=cpu_flags())


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
    reduced = int8_weights_reduced(cfg.int8_target)
    quantize_onnx(float_path, int8_path, calibration.batches(), num_batches=len(calibration.pixels),
                  method=cfg.calibration_method, workdir=workdir, reduce_range=reduced)
    report = {"calibration_method": cfg.calibration_method, "calibration_data": cfg.calibration_data,
              "calibration_samples": calibration.samples, **quantized_convolutions(int8_path),
              "int8_target": cfg.int8_target, "weight_bits": 7 if reduced else 8,
              "top1_agreement": None, "max_abs_diff": None}
    why = {"vnni": "for CPUs with VNNI", "no_vnni": "for CPUs without VNNI, whose uint8 x int8 sums would saturate",
           "auto": f"as this CPU {'lacks' if reduced else 'has'} VNNI or the like; --int8_target "
                   f"{'vnni' if reduced else 'no_vnni'} for the other kind"}[cfg.int8_target]
    print(f"quantized {report['quantized']} of {report['convolutions']} convolutions to int8 (QDQ, per-channel "
          f"weights in {report['weight_bits']} bits {why}), activations calibrated ({cfg.calibration_method}) on "
          f"{report['calibration_samples']} training images of {cfg.calibration_data}", flush=True)
    if cfg.verify:
        result = compare_exports(float_path, int8_path, calibration.batches())
        report.update(top1_agreement=result["top1_agreement"], max_abs_diff=result["max_abs_diff"])
        print(f"verify int8: top-1 agreement with the float model "
              f"{round(result['top1_agreement'] * result['samples'])}/{result['samples']} on the calibration "
              f"images, largest logit difference {result['max_abs_diff']:.3g} (float logits reach "
              f"{result['max_abs_logit']:.3g})", flush=True)
    return int8_path, report


def check_sizes(cfg: Config) -> None:
    """The batch size, input size and verify tolerance: in range, before any work."""
    for key in ("batch_size", "height", "width"):
        value = getattr(cfg, key)
        if value < 0 or (key == "batch_size" and value == 0):
            raise UserInputError(f"--{key} must be a positive integer, got {value}")
    if cfg.verify_tolerance < 0:
        raise UserInputError(f"--verify_tolerance must be >= 0, got {cfg.verify_tolerance}")


class ExportRequest(NamedTuple):
    """A checked export request: the format, the input's size, and the calibration images for int8."""
    file_format: str
    height: int
    width: int
    batch_size: Optional[int]  # None: a dynamic batch
    calibration: Optional[Calibration]


def check_export_compression(cfg: Config, file_format: str) -> None:
    """A QAT or LSQ checkpoint exports as MINDIR only, unverified: its converted network carries the
    quantization ranges as FakeQuantParam, which only MindSpore Lite's converter reads."""
    check_compression(cfg.compression)
    if cfg.compression not in QUANTIZATIONS:
        return
    if file_format != "MINDIR":
        raise UserInputError(f"compression {cfg.compression} exports MINDIR only (MindSpore's {file_format} export "
                             f"has no FakeQuantParam, the quantization ranges); pass --file_format MINDIR, or export "
                             f"the float checkpoint with --file_format ONNX --quantize int8")
    if cfg.verify:
        raise UserInputError("--verify runs the file in MindSpore, which has no kernel for the quantization ranges "
                             "(FakeQuantParam) of a converted quantization-aware network; drop --verify and "
                             f"evaluate the checkpoint with eval.py --compression {cfg.compression}")


def check_export_request(cfg: Config) -> ExportRequest:
    """Every check of an export request, in one place and before any device or checkpoint is
    touched; int8's calibration images are read here, so bad calibration data fails first too."""
    if not cfg.checkpoint_file_path:
        raise UserInputError("no checkpoint given; pass --checkpoint_file_path path/to/model.ckpt")
    file_format = check_format(cfg)
    check_export_compression(cfg, file_format)
    check_sizes(cfg)
    height, width = cfg.height or cfg.eval_image_size, cfg.width or cfg.eval_image_size
    dynamic = cfg.dynamic_batch and file_format in DYNAMIC_FORMATS
    calibration = None
    if check_quantize(cfg, file_format, height, width):
        calibration = calibration_batches(cfg, batch_size=cfg.batch_size, image_size=height)
    return ExportRequest(file_format, height, width, None if dynamic else cfg.batch_size, calibration)
