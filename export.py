"""Export a trained checkpoint for inference (MINDIR by default; ONNX; AIR on Ascend).

    python export.py --config_path config/resnet50_cifar10.yaml \
        --checkpoint_file_path output/resnet50/cifar10/resnet50-90_1562.ckpt --file_format MINDIR

The batch dimension of the exported graph is fixed to --batch_size.
"""
import os
import tempfile
from typing import Optional, Sequence

import numpy as np
import mindspore as ms

from src.checkpoint import load_into_network
from src.config import Config, load_config
from src.device import init_device
from src.errors import UserInputError, run_cli
from src.resnet import create_model

FILE_FORMATS = {"MINDIR": ".mindir", "ONNX": ".onnx", "AIR": ".air"}


def export_network(net, *, file_name: str, file_format: str, batch_size: int, height: int, width: int) -> str:
    """Export `net` for an input of (batch_size, 3, height, width); written atomically. Returns the path."""
    dummy = ms.Tensor(np.zeros((batch_size, 3, height, width), np.float32))
    target = file_name + FILE_FORMATS[file_format]
    folder = os.path.dirname(os.path.abspath(target))
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".export-") as staging:
        staged = os.path.join(staging, os.path.basename(file_name))
        ms.export(net, dummy, file_name=staged, file_format=file_format)
        os.replace(staged + FILE_FORMATS[file_format], target)
    return target


def check_format(cfg: Config) -> None:
    if cfg.file_format not in FILE_FORMATS:
        raise UserInputError(f"unknown file_format '{cfg.file_format}'; choose one of {', '.join(FILE_FORMATS)}")
    if cfg.file_format == "AIR" and cfg.device_target != "Ascend":
        raise UserInputError("AIR export needs an Ascend device (--device_target Ascend); "
                             "use --file_format MINDIR or ONNX here")


def main(argv: Optional[Sequence[str]] = None) -> int:
    cfg = load_config(argv, prog="export.py")
    if not cfg.checkpoint_file_path:
        raise UserInputError("no checkpoint given; pass --checkpoint_file_path path/to/model.ckpt")
    check_format(cfg)
    init_device(cfg.device_target, device_id=cfg.device_id, mode_name="GRAPH")
    net = create_model(cfg.net_name, num_classes=cfg.class_num)
    load_into_network(net, cfg.checkpoint_file_path, what=f"{cfg.net_name} with class_num {cfg.class_num}")
    net.set_train(False)
    path = export_network(net, file_name=cfg.file_name or cfg.net_name, file_format=cfg.file_format,
                          batch_size=cfg.batch_size, height=cfg.height or cfg.eval_image_size,
                          width=cfg.width or cfg.eval_image_size)
    print(f"exported {cfg.file_format} to {path}", flush=True)
    return 0


if __name__ == "__main__":
    run_cli(main)
