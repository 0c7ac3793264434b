"""Running an exported network (MINDIR through MindSpore's graph loader, ONNX through onnxruntime).

Used by export.py (--verify: compare the export with the checkpoint network) and predict.py
(classify image files with an export). onnxruntime is optional: only ONNX files need it.
"""
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from src.data.host_stage import Normalization, host_normalize, padded_to
from src.errors import UserInputError, require_module

EXTENSIONS = {".mindir": "MINDIR", ".onnx": "ONNX", ".air": "AIR"}
ONNXRUNTIME_HINT = "pip install onnxruntime (or pip install -r requirements-dev.txt)"
# fp32 outputs of an export may differ from the checkpoint network by float rounding only.
FP32_TOLERANCE = 1e-4

Shape = Tuple[Optional[int], int, int, int]


def require_onnxruntime():
    """The onnxruntime module, or a one-line error saying how to install it."""
    return require_module("onnxruntime", needed_for="running ONNX files", install_hint=ONNXRUNTIME_HINT)


def onnx_session(path: str, threads: int = 0):
    """An onnxruntime CPU session for `path` with `threads` compute threads (0: one per core this
    process may use; onnxruntime's own default counts the machine's cores, ignoring affinity and
    container limits) and all graph optimizations. benchmark.py measures exactly this session."""
    ort = require_onnxruntime()
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or len(os.sched_getaffinity(0))
    options.inter_op_num_threads = 1  # a ResNet is one chain of operators: nothing to run side by side
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])


def file_format_of(path: str) -> str:
    """'MINDIR' or 'ONNX' from the file name; anything else is a clear error."""
    fmt = EXTENSIONS.get(os.path.splitext(path)[1].lower())
    if fmt is None or fmt == "AIR":
        what = "AIR files run on Ascend through ATC, not here" if fmt == "AIR" else "unknown extension"
        raise UserInputError(f"cannot run {path}: {what}; pass a .mindir or .onnx file from export.py")
    return fmt


def mindir_input(path: str) -> Tuple[Optional[Shape], bool]:
    """A MINDIR file's first input, read from its protobuf once: its 4 dims (batch None when
    dynamic; (batch, C, H, W) for a float file, (batch, H, W, 3) for one exported with the input
    stage; None if unreadable) and whether it is uint8 (exported with the input stage)."""
    try:
        from mindspore.train import mind_ir_pb2  # pylint: disable=import-outside-toplevel
        model = mind_ir_pb2.ModelProto()
        with open(path, "rb") as handle:
            model.ParseFromString(handle.read())
        tensor = model.graph.input[0].tensor[0]
        dims = [int(d) for d in tensor.dims]
        pixels = tensor.data_type == mind_ir_pb2.TensorProto.DataType.UINT8
    except Exception:  # an internal format: callers fall back to asking the user
        return None, False
    if len(dims) != 4:
        return None, pixels
    return (dims[0] if dims[0] > 0 else None, dims[1], dims[2], dims[3]), pixels


class ExportedModel:
    """An exported classifier: `run(batch)` gives logits. `takes_pixels`: the file was exported
    with the input stage and takes uint8 NHWC pixels, `input_shape` then is (batch|None, H, W, 3);
    otherwise it takes normalized float32 NCHW, `input_shape` (batch|None, C, H, W). `image_size`
    is (H, W) either way; `predict_pixels` runs uint8 pixels through either kind of file.
    ONNX files run on `threads` onnxruntime threads (0: one per available core)."""

    def __init__(self, path: str, threads: int = 0):
        if not os.path.isfile(path):
            raise UserInputError(f"model file not found: {path}; pass the file export.py wrote")
        self.path = path
        self.file_format = file_format_of(path)
        self.input_shape: Optional[Shape] = None
        self.takes_pixels = False
        if self.file_format == "ONNX":
            self._load_onnx(path, threads)
        else:
            self._load_mindir(path)

    def _load_onnx(self, path: str, threads: int) -> None:
        require_onnxruntime()
        try:
            self._session = onnx_session(path, threads)
        except Exception as err:  # onnxruntime raises its own exception types
            raise UserInputError(f"onnxruntime cannot load {path} ({_first_line(err)}); "
                                 f"export the model again") from None
        model_input = self._session.get_inputs()[0]
        self._input_name = model_input.name
        self.takes_pixels = model_input.type == "tensor(uint8)"
        dims = [d if isinstance(d, int) and d > 0 else None for d in model_input.shape]
        if len(dims) == 4:
            self.input_shape = tuple(dims)

    def _load_mindir(self, path: str) -> None:
        import mindspore as ms  # pylint: disable=import-outside-toplevel
        from mindspore import nn  # pylint: disable=import-outside-toplevel
        try:
            self._cell = nn.GraphCell(ms.load(path))
        except Exception as err:  # the framework raises RuntimeError/ValueError alike here
            raise UserInputError(f"MindSpore cannot load {path} ({_first_line(err)}); "
                                 f"export the model again") from None
        self.input_shape, self.takes_pixels = mindir_input(path)

    @property
    def fixed_batch(self) -> Optional[int]:
        """The batch size the file was exported with, or None when its batch is dynamic."""
        return self.input_shape[0] if self.input_shape else None

    @property
    def image_size(self) -> Optional[Tuple[int, int]]:
        """(height, width) of the input images, whatever the layout; None if unknown."""
        if not self.input_shape:
            return None
        return self.input_shape[1:3] if self.takes_pixels else self.input_shape[2:4]

    def run(self, batch: np.ndarray) -> np.ndarray:
        """Logits for one batch in the file's own layout (uint8 NHWC when `takes_pixels`, else
        float32 NCHW), of exactly `fixed_batch` samples when the batch is fixed."""
        batch = np.ascontiguousarray(batch, dtype=np.uint8 if self.takes_pixels else np.float32)
        if self.file_format == "ONNX":
            return np.asarray(self._session.run(None, {self._input_name: batch})[0])
        import mindspore as ms  # pylint: disable=import-outside-toplevel
        return self._cell(ms.Tensor(batch)).asnumpy()

    def predict(self, images: np.ndarray, batch_size: int = 32) -> np.ndarray:
        """Logits for any number of samples: batches of the exported size (the last one padded
        with zeros and cut off again) or, for a dynamic batch, of `batch_size`."""
        step = self.fixed_batch or max(1, batch_size)
        outputs = []
        for start in range(0, len(images), step):
            chunk = images[start:start + step]
            outputs.append(self.run(padded_to(chunk, step) if self.fixed_batch else chunk)[:len(chunk)])
        return np.concatenate(outputs) if outputs else np.zeros((0, 0), np.float32)

    def predict_pixels(self, pixels: np.ndarray, normalization: Normalization, batch_size: int = 32) -> np.ndarray:
        """Logits for uint8 NHWC RGB images (as the dataset and `eval_image` give them): straight
        into a file with the input stage, host-normalized to float32 NCHW for any other."""
        return self.predict(pixels if self.takes_pixels else host_normalize(pixels, normalization), batch_size)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:160]


def seeded_input(batch: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """A standard-normal NCHW float32 batch (the scale of normalized images), reproducible by seed."""
    return np.random.default_rng(seed).standard_normal((batch, 3, height, width)).astype(np.float32)


def seeded_pixels(batch: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """Uniform uint8 NHWC RGB pixels, reproducible by seed (the input of a file with the input stage)."""
    return np.random.default_rng(seed).integers(0, 256, (batch, height, width, 3), dtype=np.uint8)


def compare_logits(reference: np.ndarray, candidate: np.ndarray) -> Dict[str, float]:
    """Max abs difference, the fraction of samples with the same top-1 class, and the largest
    reference logit magnitude (float32 rounding grows with it)."""
    if reference.shape != candidate.shape:
        raise ValueError(f"output shapes differ: {reference.shape} vs {candidate.shape}")
    return {"max_abs_diff": float(np.max(np.abs(reference.astype(np.float64) - candidate))),
            "top1_agreement": float(np.mean(reference.argmax(1) == candidate.argmax(1))),
            "max_abs_logit": float(np.max(np.abs(reference)))}


def top_k(probabilities: np.ndarray, k: int) -> List[List[Tuple[int, float]]]:
    """Per row, the k most probable (class index, probability), most probable first
    (ties: the lower index first, as argmax picks)."""
    k = min(k, probabilities.shape[1])
    order = np.argsort(-probabilities, axis=1, kind="stable")[:, :k]
    return [[(int(i), float(row[i])) for i in idx] for row, idx in zip(probabilities, order)]


def list_images(paths: Sequence[str], extensions: Sequence[str]) -> List[str]:
    """Image files named directly or found (recursively, sorted) under the given folders."""
    found: List[str] = []
    for path in paths:
        if os.path.isdir(path):
            inside = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names
                      if name.lower().endswith(tuple(extensions))]
            if not inside:
                raise UserInputError(f"no images ({', '.join(extensions)}) under {path}")
            found += sorted(inside)
        elif os.path.isfile(path):
            found.append(path)
        else:
            raise UserInputError(f"image not found: {path}; pass image files or folders of images")
    return found


def resolve_image_size(model: ExportedModel, requested: int) -> int:
    """The square input side: the model's, or --image_size (which must agree with a known one)."""
    known = model.image_size
    if known and known[0] != known[1]:
        raise UserInputError(f"{model.path} takes {known[0]}x{known[1]} inputs; predict.py feeds square "
                             f"images (the eval transform): export with equal --height and --width")
    if requested < 0:
        raise UserInputError(f"--image_size must be positive, got {requested}")
    if requested and known and requested != known[0]:
        raise UserInputError(f"--image_size {requested} does not match {model.path}, which takes "
                             f"{known[0]}x{known[1]} inputs; drop --image_size")
    if requested:
        return requested
    if known:
        return known[0]
    raise UserInputError(f"cannot read the input size of {model.path}; pass --image_size")


