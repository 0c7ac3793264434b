"""Evaluate a checkpoint on every sample of the evaluation split (standalone or across ranks).

    python eval.py --config_path config/resnet50_cifar10.yaml --data_path /data/cifar-10-batches-bin \
        --checkpoint_file_path output/resnet50/cifar10/resnet50-90_1562.ckpt

--use_ema True evaluates the checkpoint's EMA weights (ema.*, written with --model_ema True).
--model_file FILE evaluates an exported file instead (.onnx float or int8 from export.py, through
onnxruntime; .mindir through MindSpore): the same dataset, transforms and counts, every sample once,
so the accuracy of what is deployed is measured; its input size must equal eval_image_size.
The last line on stdout is one JSON object: top_1_accuracy, top_5_accuracy, loss, samples, checkpoint
(null for --model_file), net_name, dataset, rank, and model_file for an exported file.
Under a launcher (--run_distribute True), each rank evaluates its share of the samples and every
rank reports the totals of the whole split.
"""
import json
from typing import Dict, Optional, Sequence

import numpy as np

from src.config import Config, load_config
from src.dataset import create_eval_dataset
from src.deploy.inference import ExportedModel
from src.device import cap_workers, init_device
from src.errors import UserInputError, run_cli
from src.resnet import create_model
from src.training.checkpoint import load_into_network
from src.training.distributed import init_distributed, launcher_device_id, local_rank_count
from src.training.metrics import evaluate, evaluate_outputs


def evaluate_model_file(cfg: Config, dataset, *, group_size: int) -> Dict:
    """An exported file on the evaluation dataset, counted as a checkpoint is; a file that does not
    fit the config (input size, number of classes) is a one-line error."""
    model = ExportedModel(cfg.model_file)
    if model.input_shape and model.input_shape[2:] != (cfg.eval_image_size, cfg.eval_image_size):
        raise UserInputError(f"{cfg.model_file} takes {model.input_shape[2]}x{model.input_shape[3]} inputs but "
                             f"eval_image_size is {cfg.eval_image_size}; pass --eval_image_size {model.input_shape[2]}")

    def run(images: np.ndarray) -> np.ndarray:
        logits = model.predict(images, batch_size=len(images))
        if logits.shape[1] != cfg.class_num:
            raise UserInputError(f"{cfg.model_file} has {logits.shape[1]} outputs but class_num is {cfg.class_num}; "
                                 f"pass --class_num {logits.shape[1]}")
        return logits
    return {**evaluate_outputs(run, dataset, group_size=group_size), "checkpoint": None, "model_file": cfg.model_file}


def main(argv: Optional[Sequence[str]] = None) -> int:
    cfg = load_config(argv, prog="eval.py")
    if bool(cfg.checkpoint_file_path) == bool(cfg.model_file):
        raise UserInputError("pass either --checkpoint_file_path path/to/model.ckpt or --model_file "
                             "path/to/exported.onnx|.mindir" + (", not both" if cfg.model_file else ""))
    local_ranks = local_rank_count(cfg.run_distribute, cfg.device_num)
    init_device(cfg.device_target, mode_name=cfg.mode_name,
                device_id=launcher_device_id(cfg.device_id) if cfg.run_distribute else cfg.device_id,
                processes_per_node=local_ranks)
    rank, group_size = init_distributed(cfg.run_distribute, cfg.device_num)
    cfg.num_parallel_workers, workers_note = cap_workers(cfg.num_parallel_workers, local_ranks)
    for note in cfg.notes + ([workers_note] if workers_note else []):
        print(note, flush=True)
    dataset = create_eval_dataset(cfg, rank=rank, group_size=group_size)
    if cfg.model_file:
        result = evaluate_model_file(cfg, dataset, group_size=group_size)
    else:
        net = create_model(cfg.net_name, num_classes=cfg.class_num)
        load_into_network(net, cfg.checkpoint_file_path, what=f"{cfg.net_name} with class_num {cfg.class_num}",
                          use_ema=cfg.use_ema)
        result = {**evaluate(net, dataset, num_classes=cfg.class_num, group_size=group_size),
                  "checkpoint": cfg.checkpoint_file_path}
    print(json.dumps({**result, "net_name": cfg.net_name, "dataset": cfg.dataset, "rank": rank}), flush=True)
    return 0


if __name__ == "__main__":
    run_cli(main)
