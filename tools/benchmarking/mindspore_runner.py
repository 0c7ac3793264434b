"""MindSpore's side: the training step train.py builds, timed in GRAPH mode, and a measuring
process's device set up as train.py sets it. Nothing here imports MindSpore before its worker has
set OpenMP's environment."""
import argparse
import time
from typing import Dict, List

import numpy as np

from src.data.host_stage import normalization_of
from src.openmp import set_openmp_environment
from tools.benchmarking.cpu_paths import CLASSES, MINDSPORE_WORKERS

# The training step's recipe: the step train.py builds for this config (create_train_step), on the
# benchmark's network, batch and size.
TRAIN_CONFIG = "config/resnet50_imagenet2012.yaml"


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
        from src.training.factory import create_train_step
        from src.training.train_step import ReadyInput
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
        # One network serves both graphs: switch BatchNorm's mode only when the phase changes. Evaluation
        # freezes the weights as eval.py's does (src.evaluation.metrics); the next training step thaws them.
        if self.training != training:
            self.train_cell.set_train(training)
            self.training = training
            if not training:
                from src.cpu_layers import freeze_weights, uses_onednn
                if uses_onednn(self.net):
                    freeze_weights()

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
        from src.evaluation.model_summary import model_summary
        return model_summary(self.net, image_size=int(self.one.shape[-1]))

    def export_onnx(self, folder: str, batch: int, size: int, pixels: bool = False) -> List[str]:
        """The network in inference mode as ONNX files for batch 1 and `batch` (ONNX batches are
        fixed); `pixels`: with the input stage in front (uint8 NHWC in)."""
        from src.data.input_stage import WithInputStage
        from src.deploy.exporting import export_network
        self._set_training(False)
        net = WithInputStage(self.net, normalization_of("imagenet2012")) if pixels else self.net
        net.set_train(False)
        return [export_network(net, file_name=f"{self.name}{'_pixels' if pixels else ''}_b{n}", file_format="ONNX",
                               batch_size=n, height=size, width=size, staging=folder, pixels=pixels)
                for n in (1, batch)]


def mindspore_runner(args: argparse.Namespace) -> MindSporeRunner:
    """The device set up as train.py sets it for the worker's cpu_convolution and amp_level, and the
    runner; a path that cannot run here (our layers not built) is an error line."""
    set_openmp_environment()  # before the first import of MindSpore, in its workers alone (PyTorch keeps its default)
    from src.cpu_layers import library
    from src.runtime import set_up_runtime
    if args.cpu_isa != "all" and not library.unavailable_reason():
        library.cap_isa(args.cpu_isa)
    cpu_convolution, amp_level, cpu_amp_dtype = MINDSPORE_WORKERS[args.worker]
    cfg = train_config(args.net, args.batch_size, args.image_size, cpu_convolution, amp_level)
    runtime = set_up_runtime("CPU", cpu_convolution=cfg.cpu_convolution, mode_name="GRAPH", cpu_threads=args.threads,
                             amp_level=cfg.amp_level, cpu_amp_dtype=cpu_amp_dtype)
    return MindSporeRunner(args.net, args.batch_size, args.image_size, cfg, runtime.convolutions)
