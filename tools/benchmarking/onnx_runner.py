"""onnxruntime's side: the MindSpore network exported to ONNX, evaluated in the session predict.py
uses; its int8 files quantized as export.py --quantize does."""
import os
import tempfile
import time
from typing import List, Sequence

import numpy as np

from src.data.host_stage import host_normalize, normalization_of

IMAGENET = normalization_of("imagenet2012")  # the benchmark's networks take ImageNet-normalized input


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
