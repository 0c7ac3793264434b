"""Evaluate a checkpoint on every sample of the evaluation split.

    python eval.py --config_path config/resnet50_cifar10.yaml --data_path /data/cifar-10-batches-bin \
        --checkpoint_file_path output/resnet50/cifar10/resnet50-90_1562.ckpt

The last line on stdout is one JSON object: top_1_accuracy, top_5_accuracy, loss, samples, checkpoint.
"""
import json
from typing import Dict, Optional, Sequence

from mindspore import nn
from mindspore.train import Model, Top1CategoricalAccuracy, Top5CategoricalAccuracy

from src.checkpoint import load_into_network
from src.config import Config, load_config
from src.dataset import create_dataset
from src.device import init_device
from src.errors import UserInputError, run_cli
from src.loss import create_loss
from src.metrics import SampleCount
from src.resnet import create_model


def create_eval_dataset(cfg: Config, data_path: str):
    return create_dataset(cfg.dataset, data_path, training=False, batch_size=cfg.batch_size,
                          image_size=cfg.eval_image_size, class_num=cfg.class_num,
                          num_parallel_workers=cfg.num_parallel_workers)


def evaluate(net: nn.Cell, dataset, num_classes: int) -> Dict[str, float]:
    """Top-1/top-5 accuracy, mean loss and the sample count of `net` over `dataset`."""
    metrics = {"top_1_accuracy": Top1CategoricalAccuracy(), "top_5_accuracy": Top5CategoricalAccuracy(),
               "loss": nn.Loss(), "samples": SampleCount()}
    model = Model(net, loss_fn=create_loss(num_classes=num_classes), metrics=metrics)
    return model.eval(dataset, dataset_sink_mode=False)


def main(argv: Optional[Sequence[str]] = None) -> int:
    cfg = load_config(argv, prog="eval.py")
    if not cfg.checkpoint_file_path:
        raise UserInputError("no checkpoint given; pass --checkpoint_file_path path/to/model.ckpt")
    init_device(cfg.device_target, device_id=cfg.device_id, mode_name=cfg.mode_name)
    dataset = create_eval_dataset(cfg, cfg.data_path)
    net = create_model(cfg.net_name, num_classes=cfg.class_num)
    load_into_network(net, cfg.checkpoint_file_path, what=f"{cfg.net_name} with class_num {cfg.class_num}")
    net.set_train(False)
    result = evaluate(net, dataset, cfg.class_num)
    print(json.dumps({**result, "checkpoint": cfg.checkpoint_file_path,
                      "net_name": cfg.net_name, "dataset": cfg.dataset}), flush=True)
    return 0


if __name__ == "__main__":
    run_cli(main)
