"""Static int8 quantization of an ONNX export with onnxruntime, and what it changed.

QDQ format (QuantizeLinear/DequantizeLinear pairs around the float operators, which onnxruntime's
CPU provider fuses into int8 kernels), weights int8 per output channel, activations uint8 with
ranges calibrated on batches the caller supplies (export.py: training images through the
evaluation transform). onnxruntime's guidance for x86 CPUs with VNNI: uint8 activations, int8
weights, no reduced range. Without VNNI its x86 kernels multiply uint8 by int8 with an instruction
(VPMADDUBSW) whose pairwise sums saturate at 16 bits, which cost ResNet18 2.2 points of top-1 on the
digits on an AMD EPYC with AVX2 (docs/export.md); weights in 7 bits (its reduce_range) cannot
saturate there: `int8_target` chooses. Needs the `onnx` package besides onnxruntime.
"""
import os
from collections import Counter
from typing import Dict, Iterable, Iterator, List, Set

import numpy as np

from src.deploy.inference import ExportedModel, compare_logits, require_onnxruntime
from src.errors import UserInputError, require_module

CALIBRATION_METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile"}
# The CPUs an int8 file is for: with VNNI (x86's AVX512-VNNI or AVX-VNNI; aarch64's dot products
# do not saturate either), without it (7-bit weights), or those of the CPU that exports it.
INT8_TARGETS = ("auto", "vnni", "no_vnni")
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni"})
QUANTIZE_HINT = "pip install onnx onnxruntime (requirements-dev.txt pins both)"
# Per-channel DequantizeLinear (the axis attribute) exists from opset 13; MindSpore exports opset 11.
MIN_OPSET = 13


def require_quantization():
    """onnxruntime.quantization, or a one-line error saying how to install what it needs."""
    require_onnxruntime()
    require_module("onnx", needed_for="quantizing ONNX files", install_hint=QUANTIZE_HINT)
    return require_module("onnxruntime.quantization", needed_for="quantizing ONNX files",
                          install_hint=QUANTIZE_HINT)


class _BatchReader:
    """onnxruntime's calibration reader over `num_batches` batches drawn from `batches` in order.

    quantize_static collects ranges over the ranges set_range names (its strided mode), one
    batch at a time here, so memory holds one batch's activations whatever the sample count
    (its histogram calibrators otherwise keep every activation of every batch)."""

    def __init__(self, input_name: str, batches: Iterator[np.ndarray], num_batches: int):
        self.input_name, self.batches, self.num_batches = input_name, batches, num_batches
        self.pending = 0

    def __len__(self) -> int:
        return self.num_batches

    def set_range(self, start_index: int, end_index: int) -> None:
        self.pending = end_index - start_index

    def get_next(self):
        if self.pending <= 0:
            return None
        self.pending -= 1
        batch = next(self.batches, None)
        return None if batch is None else {self.input_name: np.ascontiguousarray(batch, dtype=np.float32)}


def reduces_range(int8_target: str, *, x86: bool, flags: Set[str]) -> bool:
    """Whether an int8 file for `int8_target` keeps its weights in 7 bits (onnxruntime's
    reduce_range): for CPUs without VNNI, or with `auto` where this CPU (x86 with `flags`, or not
    x86) is one of them."""
    if int8_target not in INT8_TARGETS:
        raise UserInputError(f"unknown --int8_target '{int8_target}'; choose one of {', '.join(INT8_TARGETS)} "
                             f"(the CPUs the int8 file will run on)")
    if int8_target == "auto":
        return x86 and not VNNI_FLAGS & set(flags)
    return int8_target == "no_vnni"


def quantize_onnx(float_path: str, int8_path: str, batches: Iterable[np.ndarray], *, num_batches: int,
                  method: str = "minmax", workdir: str, reduce_range: bool = False) -> None:
    """Write the int8 (QDQ) model of the float ONNX file `float_path` to `int8_path`, activation
    ranges calibrated on `num_batches` float32 NCHW batches of the file's input size, weights in 7
    bits with `reduce_range` (for CPUs without VNNI). `workdir` holds the intermediate files (opset
    upgrade, onnxruntime's pre-processing)."""
    quantization = require_quantization()
    import onnx  # pylint: disable=import-outside-toplevel
    from onnx import version_converter  # pylint: disable=import-outside-toplevel
    from onnxruntime.quantization.shape_inference import quant_pre_process  # pylint: disable=import-outside-toplevel
    if method not in CALIBRATION_METHODS:
        raise UserInputError(f"unknown calibration method '{method}'; choose one of {', '.join(CALIBRATION_METHODS)}")
    model = onnx.load(float_path)
    if _opset(model) < MIN_OPSET:
        model = version_converter.convert_version(model, MIN_OPSET)
    upgraded = os.path.join(workdir, "opset.onnx")
    prepared = os.path.join(workdir, "prepared.onnx")
    onnx.save(model, upgraded)
    # Shape inference and graph optimization first (BatchNorm folded into the convolutions), as
    # onnxruntime recommends: ranges are then calibrated on the tensors that get quantized. ONNX's own
    # shape inference covers our fixed-shape files; the symbolic one is skipped because it imports
    # onnxruntime.tools, which imports PyTorch where it is installed (~2 CPU-s). The int8 file's nodes
    # and weights come out the same; it lacks one shape annotation (the last MatMul's output).
    quant_pre_process(upgraded, prepared, skip_symbolic_shape=True)
    reader = _BatchReader(model.graph.input[0].name, iter(batches), num_batches)
    quantization.quantize_static(
        prepared, int8_path, reader, quant_format=quantization.QuantFormat.QDQ, per_channel=True,
        activation_type=quantization.QuantType.QUInt8, weight_type=quantization.QuantType.QInt8,
        reduce_range=reduce_range,
        calibrate_method=getattr(quantization.CalibrationMethod, CALIBRATION_METHODS[method]),
        extra_options={"CalibStridedMinMax": 1})


def _opset(model) -> int:
    return max(entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx"))


def quantized_convolutions(path: str) -> Dict[str, int]:
    """Counts in an ONNX file: 'convolutions' (Conv, QLinearConv, ConvInteger nodes) and 'quantized'
    (those computing in int8: QLinearConv/ConvInteger, or a Conv whose input and weight both come
    from DequantizeLinear nodes, the QDQ form)."""
    import onnx  # pylint: disable=import-outside-toplevel
    graph = onnx.load(path).graph
    producers = {output: node.op_type for node in graph.node for output in node.output}
    counts: Counter = Counter()
    for node in graph.node:
        if node.op_type in ("QLinearConv", "ConvInteger"):
            counts["convolutions"] += 1
            counts["quantized"] += 1
        elif node.op_type == "Conv":
            counts["convolutions"] += 1
            counts["quantized"] += all(producers.get(name) == "DequantizeLinear" for name in node.input[:2])
    return {"convolutions": counts["convolutions"], "quantized": counts["quantized"]}


def compare_exports(reference_path: str, candidate_path: str, batches: Iterable[np.ndarray],
                    threads: int = 0) -> Dict[str, float]:
    """compare_logits of two exported files run on the same batches (e.g. int8 against float)."""
    reference, candidate = ExportedModel(reference_path, threads), ExportedModel(candidate_path, threads)
    expected: List[np.ndarray] = []
    actual: List[np.ndarray] = []
    for batch in batches:
        expected.append(reference.predict(batch, batch_size=len(batch)))
        actual.append(candidate.predict(batch, batch_size=len(batch)))
    if not expected:
        raise UserInputError("no batches to compare the exports on")
    result = compare_logits(np.concatenate(expected), np.concatenate(actual))
    return {**result, "samples": int(sum(len(b) for b in expected))}

