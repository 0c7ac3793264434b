"""Train a ResNet on CIFAR-10 or an ImageNet-style folder: standalone or data-parallel.

    python train.py --config_path config/resnet50_cifar10.yaml --data_path /data/cifar-10-batches-bin
    python train.py --config_path ... --resume True          # continue the run in its run folder
    python train.py --config_path ... --pre_trained CKPT --compression prune|qat|lsq   # docs/compression.md
    bash scripts/run_distribute_train.sh DATASET_PATH CONFIG_PATH --workers 8
    python train.py --help                                   # every config key, its type and default
"""
import gc

gc.disable()  # while the modules load; run_cli collects again (src/errors.py)

from src.openmp import set_openmp_environment

set_openmp_environment()  # before MindSpore is imported (it loads OpenMP, which reads it once)

import os
import sys
from typing import Optional, Sequence, Tuple

from src.collective import all_gather_ints
from src.compression import LSQ, PRUNE, SCOP, compression_convolutions, mindspore_convolution_stages
from src.config import Config, load_config, run_dir, save_config
from src.data.image_decode import partial_decoder
from src.dataset import check_data, create_eval_dataset, create_train_dataset, set_start_epoch
from src.device import cap_workers
from src.errors import run_cli
from src.evaluation.model_summary import model_summary, parameter_bytes, summary_line
from src.files import remove_stale_temporaries
from src.resnet import probe_layers
from src.runtime import set_up_runtime
from src.training.board import Board
from src.training.callbacks import EvalMonitor
from src.training.distributed import (
    check_output_storage,
    check_resume_agreement,
    init_distributed,
    launcher_device_id,
    local_rank_count,
    set_data_parallel,
    stopped_exit_code,
    writes_run_folder,
)
from src.training.factory import (
    check_sink_size,
    check_step_keys,
    choose_channels_by_scop,
    create_network,
    create_schedule,
    create_train_model,
    fusion_points,
    real_sink,
    seed_everything,
    start_lsq_steps,
)
from src.training.faults import DivergedError, GracefulStop, TrainingStopped
from src.training.loop import create_callbacks, end_run, replay_divergence, start_board, train_rest_of_epoch
from src.training.precision import resolve_amp_level
from src.training.resume import check_fresh_run_folder, resume_checkpoint, resume_position, run_finished
from src.training.run_record import RunRecord
from src.training.thor import THOR, create_thor_model


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = load_config(argv, prog="train.py")
    check_step_keys(cfg)
    check_output_storage(cfg.output_storage)
    local_ranks = local_rank_count(cfg.run_distribute, cfg.device_num)
    cpu_convolution, compression_note = compression_convolutions(cfg.compression, cfg.cpu_convolution,
                                                                 cfg.device_target)
    convolutions, convolutions_note, _ = set_up_runtime(
        cfg.device_target, cpu_convolution=cpu_convolution, mode_name=cfg.mode_name,
        device_id=launcher_device_id(cfg.device_id) if cfg.run_distribute else cfg.device_id,
        processes_per_node=local_ranks, amp_level=resolve_amp_level(cfg.amp_level, cfg.device_target),
        optimizer=cfg.optimizer, cpu_amp_dtype=cfg.cpu_amp_dtype,
        probe_layers=probe_layers(cfg.net_name, cfg.train_image_size, cfg.batch_size),
        mindspore_stages=mindspore_convolution_stages(cfg.compression, cfg.prune_criterion))
    rank, group_size = init_distributed(cfg.run_distribute, cfg.device_num)
    seed_everything(cfg.seed)
    folder = run_dir(cfg)
    writer = writes_run_folder(rank, local_ranks, cfg.output_storage)
    log = print if rank == 0 else (lambda message: print(f"[rank {rank}] {message}", flush=True))
    cfg.num_parallel_workers, workers_note = cap_workers(cfg.num_parallel_workers, local_ranks)
    for note in cfg.notes + [line for line in (workers_note, compression_note, convolutions_note) if line]:
        log(note)
    if cfg.check_data and rank == 0:
        check_data(cfg, log)

    net = create_network(cfg, log, convolutions)
    split_points = fusion_points(cfg, net) if group_size > 1 else []
    if group_size > 1:
        set_data_parallel(group_size, split_points)
    dataset = create_train_dataset(cfg, rank, group_size, folder)
    steps_per_epoch = dataset.get_dataset_size()
    check_sink_size(cfg, steps_per_epoch)
    eval_dataset = create_eval_dataset(cfg, rank=rank, group_size=group_size) if cfg.run_eval else None
    lrs = create_schedule(cfg, steps_per_epoch, log)
    counted = model_summary(net, image_size=cfg.train_image_size)  # before THOR swaps the Conv2d/Dense cells
    # Known before the train step copies the weights (its EMA): a fresh LSQ run starts its steps from data.
    resume_from = resume_checkpoint(cfg, folder, steps_per_epoch, log)
    if not resume_from and writer and not cfg.resume:
        check_fresh_run_folder(folder, cfg.net_name)  # before LSQ's start, which runs the network
    if cfg.compression == LSQ and not resume_from:
        start_lsq_steps(cfg, net, group_size, log)
    if cfg.compression == PRUNE and cfg.prune_criterion == SCOP and not resume_from:
        choose_channels_by_scop(cfg, net, rank=rank, group_size=group_size, steps_per_epoch=steps_per_epoch, log=log)
    if cfg.optimizer == THOR:
        log(f"optimizer Thor: MindSpore's nn.thor and ModelThor in dataset sink mode, matrices refreshed every "
            f"{cfg.frequency} steps; this repository's training step (EMA, accumulation, clipping) is not used")
        model = create_thor_model(cfg, net, lrs, steps_per_epoch=steps_per_epoch, fusion_points=split_points,
                                  group_size=group_size)
    else:
        model = create_train_model(cfg, net, lrs, steps_per_epoch=steps_per_epoch, group_size=group_size)

    # Everything that can be wrong with the input is checked above; only now is anything written.
    start_epoch = first_step = 0
    if resume_from:
        start_epoch, first_step = resume_position(resume_from, net, model, steps_per_epoch, cfg.epoch_size,
                                                  mid_epoch=not real_sink(cfg), relaunch=not cfg.resume_ckpt)
    if group_size > 1 and (cfg.resume or cfg.resume_ckpt):
        check_resume_agreement(all_gather_ints(first_step if resume_from else -1, rank, group_size),
                               local_ranks, folder)
    complete = first_step == cfg.epoch_size * steps_per_epoch  # a relaunch found the last checkpoint
    if complete and run_finished(folder, first_step, group_size):
        log(f"resume: the run in {folder} is finished ({resume_from} is its last checkpoint, epoch "
            f"{cfg.epoch_size} of {cfg.epoch_size}, and its end is done); nothing is left to do")
        return 0
    set_start_epoch(dataset, start_epoch)
    record, board = open_run_folder(cfg, folder, dataset, resume_step=first_step if resume_from else None,
                                    rank=rank, group_size=group_size, log=log) if writer else (None, None)
    if complete:  # killed after its last checkpoint: only its end is left
        return finish_complete_run(cfg, net, model, eval_dataset, resume_from=resume_from, folder=folder, rank=rank,
                                   writer=writer, group_size=group_size, steps_per_epoch=steps_per_epoch,
                                   record=record, board=board, log=log)
    dataset.bad_samples.reset()
    callbacks = create_callbacks(cfg, net=net, model=model, folder=folder, rank=rank, writer=writer,
                                 group_size=group_size,
                                 steps_per_epoch=steps_per_epoch, lrs=lrs, first_step=first_step,
                                 eval_dataset=eval_dataset, record=record, board=board, log=log,
                                 bad_samples=dataset.bad_samples, argv=argv, local_ranks=local_ranks,
                                 convolutions=convolutions)

    log_run_start(cfg, model, counted, folder=folder, start_epoch=start_epoch, steps_per_epoch=steps_per_epoch,
                  group_size=group_size, resumed=f"; resumed from {resume_from} at global step {first_step}"
                  if resume_from else "", log=log)
    next(callback for callback in callbacks if isinstance(callback, GracefulStop)).install()
    try:
        if first_step > start_epoch * steps_per_epoch:
            start_epoch = train_rest_of_epoch(cfg, model, callbacks, rank=rank, group_size=group_size, folder=folder,
                                              first_step=first_step, steps_per_epoch=steps_per_epoch)
            set_start_epoch(dataset, start_epoch)
        if start_epoch < cfg.epoch_size:
            model.train(cfg.epoch_size, dataset, callbacks=callbacks, dataset_sink_mode=cfg.dataset_sink_mode,
                        sink_size=cfg.sink_size if cfg.dataset_sink_mode else -1, initial_epoch=start_epoch)
        monitor = next((callback for callback in callbacks if isinstance(callback, EvalMonitor)), None)
        end_run(cfg, net, model, eval_dataset, folder=folder, rank=rank, writer=writer, group_size=group_size,
                steps_per_epoch=steps_per_epoch, record=record, board=board, log=log,
                evaluated=monitor.best_evaluation if monitor and group_size == 1 else None)
    except TrainingStopped as stopped:
        return stopped_exit_code(stopped.exit_code)
    except DivergedError as diverged:
        if diverged.step is None:
            raise
        where = replay_divergence(cfg, net, diverged.step, rank=rank, group_size=group_size, folder=folder)
        raise DivergedError(f"{diverged}; {where}", step=diverged.step) from None
    finally:
        if board:
            board.close()
    return 0


def finish_complete_run(cfg: Config, net, model, eval_dataset, *, resume_from: str, folder: str, rank: int,
                        writer: bool, group_size: int, steps_per_epoch: int, record: Optional[RunRecord],
                        board: Optional[Board], log) -> int:
    """A relaunch that finds the run's last checkpoint but not its end done (it was killed after that
    checkpoint): the end alone, as the uninterrupted run does it, and no training step."""
    try:
        done = end_run(cfg, net, model, eval_dataset, folder=folder, rank=rank, writer=writer,
                       group_size=group_size, steps_per_epoch=steps_per_epoch, record=record, board=board, log=log)
    finally:
        if board:
            board.close()
    log(f"resume: {resume_from} is the run's last checkpoint (epoch {cfg.epoch_size} of {cfg.epoch_size}): the "
        f"run was complete; finished its end ({', '.join(done)}), no training step")
    return 0


def open_run_folder(cfg: Config, folder: str, dataset, *, resume_step: Optional[int], rank: int, group_size: int,
                    log) -> Tuple[RunRecord, Optional[Board]]:
    """The run folder, ready to write into: temporaries of an interrupted run removed, the config
    saved, the run record (metrics.csv) and TensorBoard opened, continuing at `resume_step` if given."""
    os.makedirs(folder, exist_ok=True)
    removed = remove_stale_temporaries(folder)
    if removed:
        log(f"removed {len(removed)} temporary file(s) left by an interrupted run: {', '.join(removed)}")
    save_config(cfg, os.path.join(folder, "config.yaml"))
    board = Board(folder, resume_step=resume_step) if cfg.tensorboard else None
    record = RunRecord(folder, resume_step=resume_step, board=board)
    if board and resume_step is None:
        start_board(cfg, board, dataset, rank=rank, group_size=group_size)
    return record, board


def log_run_start(cfg: Config, model, counted: dict, *, folder: str, start_epoch: int, steps_per_epoch: int,
                  group_size: int, resumed: str, log) -> None:
    """What is about to train, and the notes that explain its speed."""
    log(summary_line(cfg.net_name, dict(counted, checkpoint_mb=parameter_bytes(model.train_network) / 2**20),
                     "training checkpoint (weights and optimizer state)"))
    micro_batches = f" x {cfg.grad_accumulation_steps} micro-batches" if cfg.grad_accumulation_steps > 1 else ""
    log(f"training {cfg.net_name} on {cfg.dataset} ({cfg.data_path}): epochs {start_epoch + 1}..{cfg.epoch_size} x "
        f"{steps_per_epoch} steps of {cfg.batch_size}{micro_batches} x {group_size} rank(s); amp "
        f"{resolve_amp_level(cfg.amp_level, cfg.device_target)}; run folder {folder}"
        + (f"; EMA every {cfg.model_ema_steps} steps, alpha {model.train_network.ema_alpha.asnumpy():.6g}"
           if cfg.model_ema else "") + resumed)
    if cfg.dataset != "cifar10" and partial_decoder() is None:
        log("note: JPEGs are decoded with Pillow (slower): the partial decoder src/data/native/libjpeg_crop.so is not "
            "built; run bash scripts/setup_env.sh (it needs cc and libjpeg-dev)")
    if cfg.dataset_sink_mode and cfg.device_target == "CPU":
        log("dataset_sink_mode: MindSpore has no CPU sink, so steps run one by one (logs stay per step)")


if __name__ == "__main__":
    run_cli(main)
