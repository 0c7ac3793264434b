"""Evaluate a checkpoint on every sample of the evaluation split (standalone or across ranks).

    python eval.py --config_path config/resnet50_cifar10.yaml --data_path /data/cifar-10-batches-bin \
        --checkpoint_file_path output/resnet50/cifar10/resnet50-90_1562.ckpt

--use_ema True evaluates the checkpoint's EMA weights (ema.*, written with --model_ema True).
--compression qat|lsq|prune evaluates a checkpoint of train.py --compression qat|lsq|prune (docs/compression.md;
a pruned network is rebuilt to the widths its checkpoint's weights have).
--model_file FILE evaluates an exported file instead (.onnx float or int8 from export.py, through
onnxruntime; .mindir through MindSpore): the same dataset, transforms and counts, every sample once,
so the accuracy of what is deployed is measured; its input size must equal eval_image_size. A file
exported with --export_input_stage True gets the uint8 pixels, any other them normalized on the host.
The JSON object on stdout holds top_1_accuracy, top_5_accuracy, loss, samples, checkpoint (null for
--model_file), net_name, dataset, rank, and model_file for an exported file; it is the last line
unless --report_dir is given.
--report_dir DIR also writes per_class.csv, confusion.csv, confusion.png (confusions.png above 100
classes) and calibration.png there, adds `ece` to the JSON line and prints the five worst classes and
the five most confused pairs after it; --save_predictions True adds predictions.csv (top-5 per image).
--summary True first prints the model's parameters, GFLOPs per image and checkpoint size.
Under a launcher (--run_distribute True), each rank evaluates its share of the samples and every
rank reports the totals of the whole split.
"""
import gc

gc.disable()  # while the modules load; run_cli collects again (src/errors.py)

from src.openmp import set_openmp_environment

set_openmp_environment()  # before MindSpore is imported (it loads OpenMP, which reads it once)

import json
import os
from typing import Callable, Optional, Sequence

import numpy as np
from mindspore import nn

from src.compression import check_compression, compression_convolutions
from src.config import Config, load_config
from src.data.host_stage import normalization_of
from src.dataset import create_eval_dataset
from src.deploy.inference import ExportedModel
from src.device import cap_workers
from src.errors import UserInputError, run_cli
from src.evaluation.metrics import evaluate, evaluate_outputs
from src.evaluation.model_summary import model_summary, summary_line
from src.evaluation.report import evaluate_with_report, save_report
from src.runtime import set_up_runtime
from src.training.checkpoint import network_from_checkpoint
from src.training.distributed import init_distributed, launcher_device_id, local_rank_count


def check_request(cfg: Config) -> None:
    """One line for a request that cannot work, before any device or data is touched."""
    if bool(cfg.checkpoint_file_path) == bool(cfg.model_file):
        raise UserInputError("pass either --checkpoint_file_path path/to/model.ckpt or --model_file "
                             "path/to/exported.onnx|.mindir" + (", not both" if cfg.model_file else ""))
    if cfg.report_dir and os.path.exists(cfg.report_dir) and not os.path.isdir(cfg.report_dir):
        raise UserInputError(f"report_dir {cfg.report_dir} is a file; pass a folder for the report")
    if cfg.save_predictions and not cfg.report_dir:
        raise UserInputError("--save_predictions True writes predictions.csv into the report folder; "
                             "pass --report_dir DIR too")
    if cfg.use_ema and cfg.model_file:
        raise UserInputError("--use_ema True picks a checkpoint's EMA weights; an exported file holds one set of "
                             "weights (export the EMA weights with export.py --use_ema True), drop --use_ema")
    if cfg.summary and cfg.model_file:
        raise UserInputError("--summary True describes a checkpoint's network; pass --checkpoint_file_path "
                             "(an exported file has no network to count)")
    check_compression(cfg.compression)
    if cfg.compression != "none" and cfg.model_file:
        raise UserInputError("--compression describes a checkpoint's network; an exported file is evaluated as it "
                             "is, drop --compression")


def model_file_predictor(cfg: Config) -> Callable[[np.ndarray], np.ndarray]:
    """An exported file as a function from a uint8 NHWC batch (the dataset's) to logits: a file with
    the input stage takes the pixels, a float file gets them normalized on the host. A file that does
    not fit the config (input size, number of classes) is a one-line error."""
    model = ExportedModel(cfg.model_file)
    size = model.image_size
    if size and size != (cfg.eval_image_size, cfg.eval_image_size):
        raise UserInputError(f"{cfg.model_file} takes {size[0]}x{size[1]} inputs but "
                             f"eval_image_size is {cfg.eval_image_size}; pass --eval_image_size {size[0]}")
    normalization = normalization_of(cfg.dataset)

    def run(images: np.ndarray) -> np.ndarray:
        logits = model.predict_pixels(images, normalization, batch_size=len(images))
        if logits.shape[1] != cfg.class_num:
            raise UserInputError(f"{cfg.model_file} has {logits.shape[1]} outputs but class_num is {cfg.class_num}; "
                                 f"pass --class_num {logits.shape[1]}")
        return logits
    return run


def load_network(cfg: Config, rank: int, convolutions: str = "mindspore") -> nn.Cell:
    """The checkpoint's network (its summary printed first with --summary True)."""
    net = network_from_checkpoint(cfg.net_name, cfg.class_num, cfg.checkpoint_file_path, use_ema=cfg.use_ema,
                                  convolutions=convolutions, compression=cfg.compression)
    if cfg.summary and rank == 0:
        print(summary_line(cfg.net_name, model_summary(net, image_size=cfg.eval_image_size,
                                                       checkpoint_bytes=os.path.getsize(cfg.checkpoint_file_path))),
              flush=True)
    return net


def main(argv: Optional[Sequence[str]] = None) -> int:
    cfg = load_config(argv, prog="eval.py")
    check_request(cfg)
    local_ranks = local_rank_count(cfg.run_distribute, cfg.device_num)
    cpu_convolution, compression_note = compression_convolutions(cfg.compression, cfg.cpu_convolution,
                                                                 cfg.device_target)
    convolutions, convolutions_note, _ = set_up_runtime(
        cfg.device_target, cpu_convolution=cpu_convolution, mode_name=cfg.mode_name,
        device_id=launcher_device_id(cfg.device_id) if cfg.run_distribute else cfg.device_id,
        processes_per_node=local_ranks)
    rank, group_size = init_distributed(cfg.run_distribute, cfg.device_num)
    cfg.num_parallel_workers, workers_note = cap_workers(cfg.num_parallel_workers, local_ranks)
    for note in cfg.notes + [line for line in (workers_note, compression_note, convolutions_note) if line]:
        print(note, flush=True)
    dataset = create_eval_dataset(cfg, rank=rank, group_size=group_size)
    run = model_file_predictor(cfg) if cfg.model_file else None
    net = None if run else load_network(cfg, rank, convolutions)
    report = None
    if cfg.report_dir:
        result, report = evaluate_with_report(net, dataset, num_classes=cfg.class_num, group_size=group_size,
                                              keep_predictions=cfg.save_predictions, run=run)
    elif run:
        result = evaluate_outputs(run, dataset, group_size=group_size)
    else:
        result = evaluate(net, dataset, group_size=group_size)
    evaluated = {"model_file": cfg.model_file} if run else {}
    print(json.dumps({**result, "checkpoint": cfg.checkpoint_file_path or None, **evaluated,
                      "net_name": cfg.net_name, "dataset": cfg.dataset, "rank": rank}), flush=True)
    if report is not None and rank == 0:  # every rank holds the same sums; one writes them
        save_report(cfg.report_dir, report, source=dataset.sample_source, num_classes=cfg.class_num,
                    title=f"{cfg.net_name} on {cfg.dataset}: {cfg.model_file or cfg.checkpoint_file_path}",
                    log=lambda line: print(line, flush=True), pictures=cfg.plot_curves)
    return 0


if __name__ == "__main__":
    run_cli(main)
