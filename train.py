"""Train a ResNet on CIFAR-10 or an ImageNet-style folder: standalone or data-parallel.

    python train.py --config_path config/resnet50_cifar10.yaml --data_path /data/cifar-10-batches-bin
    python train.py --config_path ... --resume True          # continue the run in its run folder
    bash scripts/run_distribute_train.sh DATASET_PATH CONFIG_PATH --workers 8
    python train.py --help                                   # every config key, its type and default
"""
import os
import random
from typing import Optional, Sequence

import numpy as np
import mindspore as ms
import mindspore.dataset as mds
from mindspore.train import Model

from src.callbacks import (CheckpointSaver, EvalMonitor, FinalState, ProfilerMonitor, RecordPlotter,
                           TrainMonitor)
from src.checkpoint import (find_latest, list_checkpoints, load_pretrained, network_mismatches,
                            raise_if_mismatched, read_checkpoint, restore_training_state, training_position)
from src.config import Config, load_config, run_dir, save_config
from src.dataset import create_dataset, create_eval_dataset, set_start_epoch
from src.device import init_device
from src.distributed import (check_fusion_points, fusion_split_points, init_distributed, launcher_device_id,
                             set_data_parallel)
from src.errors import UserInputError, run_cli
from src.loss import create_loss
from src.lr_schedule import create_lr_schedule
from src.optimizer import check_optimizer, create_optimizer
from src.precision import create_loss_scale_manager, mixed_precision_network, resolve_amp_level
from src.resnet import create_model
from src.run_record import RunRecord
from src.train_step import NetWithLoss, TrainStep, check_ema_decay, ema_schedule


def seed_everything(seed: int) -> None:
    """One seed for MindSpore, its data pipeline, NumPy and Python (the same on every rank)."""
    ms.set_seed(seed)
    mds.config.set_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def create_train_dataset(cfg: Config, rank: int, group_size: int):
    # One batch feeds one optimizer step: grad_accumulation_steps micro-batches of batch_size.
    return create_dataset(cfg.dataset, cfg.data_path, training=True,
                          batch_size=cfg.batch_size * cfg.grad_accumulation_steps,
                          image_size=cfg.train_image_size, class_num=cfg.class_num,
                          num_parallel_workers=cfg.num_parallel_workers, num_shards=group_size,
                          shard_id=rank, seed=cfg.seed)


def create_schedule(cfg: Config, steps_per_epoch: int) -> np.ndarray:
    return create_lr_schedule(
        cfg.lr_decay_mode, lr_init=cfg.lr_init, lr_max=cfg.lr_max, lr_end=cfg.lr_end,
        total_steps=cfg.epoch_size * steps_per_epoch,
        warmup_steps=int(cfg.warmup_epochs * steps_per_epoch),
        milestones=[int(epoch * steps_per_epoch) for epoch in cfg.lr_decay_epochs],
        gamma=cfg.lr_decay_factor, power=cfg.lr_poly_power)


def create_network(cfg: Config):
    net = create_model(cfg.net_name, num_classes=cfg.class_num, conv_init=cfg.conv_init,
                       dense_init=cfg.dense_init, zero_init_residual=cfg.zero_init_residual,
                       freeze_bn=cfg.freeze_bn)
    if cfg.pre_trained:
        skipped = load_pretrained(net, cfg.pre_trained, head=["fc.weight", "fc.bias"],
                                  filter_weight=cfg.filter_weight,
                                  what=f"{cfg.net_name} with class_num {cfg.class_num}")
        print(f"loaded pre-trained weights from {cfg.pre_trained}"
              + (f"; skipped the head: {', '.join(skipped)}" if skipped else ""), flush=True)
    return net


def fusion_points(cfg: Config, net) -> list:
    """The allreduce fusion split points: the config's (validated) or derived from the network."""
    sizes = [int(np.prod(p.shape)) for p in net.trainable_params()]
    if cfg.all_reduce_fusion_config:
        return check_fusion_points(cfg.all_reduce_fusion_config, len(sizes))
    return fusion_split_points(sizes)


def resume_checkpoint(cfg: Config, folder: str, steps_per_epoch: int) -> Optional[str]:
    """The checkpoint to continue from: resume_ckpt, or the newest in the run folder with --resume."""
    if cfg.resume_ckpt:
        return cfg.resume_ckpt
    if cfg.resume:
        return find_latest(folder, cfg.net_name, steps_per_epoch)
    return None


def check_fresh_run_folder(folder: str, net_name: str) -> None:
    """A new run never overwrites another run's checkpoints or record."""
    if list_checkpoints(folder, net_name) or os.path.exists(os.path.join(folder, "metrics.csv")):
        raise UserInputError(f"run folder {folder} already holds a run; continue it with --resume True, "
                             f"or pick another --output_dir")


def resume_position(path: str, net, model: Model, steps_per_epoch: int, epoch_size: int) -> int:
    """Restore the whole training state from `path`; returns the number of epochs already done."""
    params = read_checkpoint(path)
    raise_if_mismatched(network_mismatches(net, params), path, "this network", "resume with the same config")
    epochs_done, step = training_position(params, path)
    if step != epochs_done * steps_per_epoch:
        raise UserInputError(f"checkpoint {path} is at step {step}, not at the end of an epoch of "
                             f"{steps_per_epoch} steps; resume from an end-of-epoch checkpoint (or the "
                             f"batch size or dataset changed)")
    if epochs_done >= epoch_size:
        raise UserInputError(f"checkpoint {path} is at epoch {epochs_done} of {epoch_size}: the run is "
                             f"complete; raise --epoch_size to train on")
    restore_training_state(model.train_network, params, path)
    return epochs_done


def check_sink_size(cfg: Config, steps_per_epoch: int) -> None:
    if cfg.dataset_sink_mode and cfg.sink_size not in (-1, steps_per_epoch):
        raise UserInputError(f"sink_size {cfg.sink_size} would redefine an epoch; use -1 (one sink per epoch "
                             f"of {steps_per_epoch} steps)")


def check_step_keys(cfg: Config) -> None:
    """The optimizer and EMA keys, checked before any work (ranges are checked at load)."""
    check_optimizer(cfg.optimizer, use_nesterov=cfg.use_nesterov, momentum=cfg.momentum,
                    lars_coefficient=cfg.lars_coefficient, lars_epsilon=cfg.lars_epsilon)
    if cfg.model_ema:
        check_ema_decay(cfg.model_ema_decay)


def create_train_model(cfg: Config, net, lrs: np.ndarray, *, steps_per_epoch: int, group_size: int) -> Model:
    """The training step around `net` (loss, mixed precision, loss scaling, accumulation, clipping,
    optimizer, EMA), run by a Model."""
    amp_level = resolve_amp_level(cfg.amp_level, cfg.device_target)
    loss_scale_manager = create_loss_scale_manager(cfg.loss_scale_type, cfg.loss_scale)
    loss = create_loss(num_classes=cfg.class_num,
                       label_smooth_factor=cfg.label_smooth_factor if cfg.use_label_smooth else 0.0)
    optimizer = create_optimizer(net, name=cfg.optimizer, learning_rate=lrs, weight_decay=cfg.weight_decay,
                                 momentum=cfg.momentum, norm_weight_decay=cfg.norm_weight_decay,
                                 bias_weight_decay=cfg.bias_weight_decay, use_nesterov=cfg.use_nesterov,
                                 lars_coefficient=cfg.lars_coefficient, lars_epsilon=cfg.lars_epsilon)
    ema = ema_schedule(decay=cfg.model_ema_decay, every=cfg.model_ema_steps, world_size=group_size,
                       batch_size=cfg.batch_size, accumulation_steps=cfg.grad_accumulation_steps,
                       epochs=cfg.epoch_size, warmup_epochs=int(cfg.warmup_epochs),
                       steps_per_epoch=steps_per_epoch) if cfg.model_ema else None
    step = TrainStep(NetWithLoss(mixed_precision_network(net, amp_level), loss), optimizer, net=net,
                     loss_scale=loss_scale_manager.get_loss_scale() if loss_scale_manager else 1.0,
                     scale_update=loss_scale_manager.get_update_cell() if loss_scale_manager else None,
                     accumulation_steps=cfg.grad_accumulation_steps, micro_batch=cfg.batch_size,
                     clip_grad_norm=cfg.clip_grad_norm, ema=ema)
    return Model(step)


def create_ema_twin(cfg: Config):
    """A second network, in the same precision, that evaluation loads the EMA weights into."""
    twin = create_model(cfg.net_name, num_classes=cfg.class_num)
    mixed_precision_network(twin, resolve_amp_level(cfg.amp_level, cfg.device_target))
    return twin


def create_callbacks(cfg: Config, *, net, model: Model, folder: str, rank: int, group_size: int,
                     steps_per_epoch: int, lrs: np.ndarray, first_step: int, eval_dataset,
                     record: Optional[RunRecord], log) -> list:
    """Logging, evaluation, checkpoints, the run record and profiling; files from rank 0 only."""
    ema_params = model.train_network.ema_params if cfg.model_ema else None
    callbacks = [TrainMonitor(steps_per_epoch=steps_per_epoch, total_steps=len(lrs),
                              global_batch=cfg.batch_size * cfg.grad_accumulation_steps * group_size, lrs=lrs,
                              log_interval=cfg.log_interval, first_step=first_step, record=record, log=log)]
    if eval_dataset is not None:
        callbacks.append(EvalMonitor(net=net, ema_net=create_ema_twin(cfg) if cfg.model_ema else None,
                                     ema_params=ema_params, dataset=eval_dataset, num_classes=cfg.class_num,
                                     group_size=group_size, epoch_size=cfg.epoch_size,
                                     eval_start_epoch=cfg.eval_start_epoch, eval_interval=cfg.eval_interval,
                                     best_folder=folder if cfg.save_best_ckpt and rank == 0 else None,
                                     best_top1=best_top1(folder) if first_step else -1.0, record=record, log=log))
    if rank == 0:
        if cfg.save_checkpoint:
            callbacks.append(CheckpointSaver(folder=folder, net_name=cfg.net_name, steps_per_epoch=steps_per_epoch,
                                             epoch_size=cfg.epoch_size, save_epochs=cfg.save_checkpoint_epochs,
                                             save_steps=cfg.save_checkpoint_steps, keep=cfg.keep_checkpoint_max,
                                             first_step=first_step))
        callbacks.append(RecordPlotter(record))
    if cfg.enable_profiling:
        callbacks.append(ProfilerMonitor(folder=os.path.join(folder, "profiler", f"rank{rank}"),
                                         device_target=cfg.device_target, steps=cfg.profile_steps))
    callbacks.append(FinalState(net=net, ema_params=ema_params, folder=folder, rank=rank, first_step=first_step))
    return callbacks


def main(argv: Optional[Sequence[str]] = None) -> int:
    cfg = load_config(argv, prog="train.py")
    check_step_keys(cfg)
    init_device(cfg.device_target, mode_name=cfg.mode_name,
                device_id=launcher_device_id(cfg.device_id) if cfg.run_distribute else cfg.device_id,
                processes_per_node=cfg.device_num if cfg.run_distribute else 1)
    rank, group_size = init_distributed(cfg.run_distribute, cfg.device_num)
    seed_everything(cfg.seed)
    folder = run_dir(cfg)
    log = print if rank == 0 else (lambda message: print(f"[rank {rank}] {message}", flush=True))

    net = create_network(cfg)
    if group_size > 1:
        set_data_parallel(group_size, fusion_points(cfg, net))
    dataset = create_train_dataset(cfg, rank, group_size)
    steps_per_epoch = dataset.get_dataset_size()
    check_sink_size(cfg, steps_per_epoch)
    eval_dataset = create_eval_dataset(cfg, rank=rank, group_size=group_size) if cfg.run_eval else None
    lrs = create_schedule(cfg, steps_per_epoch)
    model = create_train_model(cfg, net, lrs, steps_per_epoch=steps_per_epoch, group_size=group_size)

    # Everything that can be wrong with the input is checked above; only now is anything written.
    resume_from = resume_checkpoint(cfg, folder, steps_per_epoch)
    start_epoch = 0
    if resume_from:
        start_epoch = resume_position(resume_from, net, model, steps_per_epoch, cfg.epoch_size)
    elif rank == 0:
        check_fresh_run_folder(folder, cfg.net_name)
    set_start_epoch(dataset, start_epoch)
    first_step = start_epoch * steps_per_epoch
    record = None
    if rank == 0:
        os.makedirs(folder, exist_ok=True)
        save_config(cfg, os.path.join(folder, "config.yaml"))
        record = RunRecord(folder, resume_step=first_step if resume_from else None)
    callbacks = create_callbacks(cfg, net=net, model=model, folder=folder, rank=rank, group_size=group_size,
                                 steps_per_epoch=steps_per_epoch, lrs=lrs, first_step=first_step,
                                 eval_dataset=eval_dataset, record=record, log=log)

    micro_batches = f" x {cfg.grad_accumulation_steps} micro-batches" if cfg.grad_accumulation_steps > 1 else ""
    log(f"training {cfg.net_name} on {cfg.dataset} ({cfg.data_path}): epochs {start_epoch + 1}..{cfg.epoch_size} x "
        f"{steps_per_epoch} steps of {cfg.batch_size}{micro_batches} x {group_size} rank(s); amp "
        f"{resolve_amp_level(cfg.amp_level, cfg.device_target)}; run folder {folder}"
        + (f"; EMA every {cfg.model_ema_steps} steps, alpha {model.train_network.ema_alpha.asnumpy():.6g}"
           if cfg.model_ema else "")
        + (f"; resumed from {resume_from}" if resume_from else ""))
    if cfg.dataset_sink_mode and cfg.device_target == "CPU":
        log("dataset_sink_mode: MindSpore has no CPU sink, so steps run one by one (logs stay per step)")
    model.train(cfg.epoch_size, dataset, callbacks=callbacks, dataset_sink_mode=cfg.dataset_sink_mode,
                sink_size=cfg.sink_size if cfg.dataset_sink_mode else -1, initial_epoch=start_epoch)
    return 0


def best_top1(folder: str) -> float:
    """The top-1 stored in the run's best.ckpt, so a resumed run keeps the real best."""
    path = os.path.join(folder, "best.ckpt")
    if not os.path.isfile(path):
        return -1.0
    return float(read_checkpoint(path)["top_1_accuracy"].asnumpy())


if __name__ == "__main__":
    run_cli(main)
