"""Train a ResNet on CIFAR-10 or an ImageNet-style folder.

    python train.py --config_path config/resnet50_cifar10.yaml --data_path /data/cifar-10-batches-bin
    python train.py --help      # every config key, its type and default
"""
import os
import random
import sys
from typing import Optional, Sequence

import numpy as np
import mindspore as ms
import mindspore.dataset as mds
from mindspore.train import FixedLossScaleManager, Model, ModelCheckpoint, CheckpointConfig

from src.callbacks import TrainMonitor
from src.config import Config, load_config, run_dir, save_config
from src.dataset import create_dataset
from src.device import init_device
from src.errors import run_cli
from src.loss import create_loss
from src.lr_schedule import create_lr_schedule
from src.optimizer import create_optimizer
from src.resnet import create_model


def seed_everything(seed: int) -> None:
    """One seed for MindSpore, its data pipeline, NumPy and Python."""
    ms.set_seed(seed)
    mds.config.set_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def create_train_dataset(cfg: Config):
    return create_dataset(cfg.dataset, cfg.data_path, training=True, batch_size=cfg.batch_size,
                          image_size=cfg.train_image_size, class_num=cfg.class_num,
                          num_parallel_workers=cfg.num_parallel_workers, seed=cfg.seed)


def create_schedule(cfg: Config, steps_per_epoch: int) -> np.ndarray:
    return create_lr_schedule(
        cfg.lr_decay_mode, lr_init=cfg.lr_init, lr_max=cfg.lr_max, lr_end=cfg.lr_end,
        total_steps=cfg.epoch_size * steps_per_epoch,
        warmup_steps=int(cfg.warmup_epochs * steps_per_epoch),
        milestones=[int(epoch * steps_per_epoch) for epoch in cfg.lr_decay_epochs],
        gamma=cfg.lr_decay_factor, power=cfg.lr_poly_power)


def create_callbacks(cfg: Config, steps_per_epoch: int, lrs: np.ndarray, folder: str) -> list:
    callbacks = [TrainMonitor(steps_per_epoch=steps_per_epoch, total_steps=len(lrs),
                              global_batch=cfg.batch_size, lrs=lrs, log_interval=cfg.log_interval)]
    if cfg.save_checkpoint:
        every = CheckpointConfig(save_checkpoint_steps=cfg.save_checkpoint_epochs * steps_per_epoch,
                                 keep_checkpoint_max=cfg.keep_checkpoint_max)
        callbacks.append(ModelCheckpoint(prefix=cfg.net_name, directory=folder, config=every))
    return callbacks


def main(argv: Optional[Sequence[str]] = None) -> int:
    cfg = load_config(argv, prog="train.py")
    init_device(cfg.device_target, device_id=cfg.device_id, mode_name=cfg.mode_name)
    seed_everything(cfg.seed)
    folder = run_dir(cfg)

    dataset = create_train_dataset(cfg)
    steps_per_epoch = dataset.get_dataset_size()
    lrs = create_schedule(cfg, steps_per_epoch)
    net = create_model(cfg.net_name, num_classes=cfg.class_num, conv_init=cfg.conv_init,
                       dense_init=cfg.dense_init, zero_init_residual=cfg.zero_init_residual)
    loss = create_loss(num_classes=cfg.class_num,
                       label_smooth_factor=cfg.label_smooth_factor if cfg.use_label_smooth else 0.0)
    optimizer = create_optimizer(net, name=cfg.optimizer, learning_rate=lrs, weight_decay=cfg.weight_decay,
                                 momentum=cfg.momentum, loss_scale=cfg.loss_scale)
    model = Model(net, loss_fn=loss, optimizer=optimizer,
                  loss_scale_manager=FixedLossScaleManager(cfg.loss_scale, drop_overflow_update=False))

    os.makedirs(folder, exist_ok=True)
    save_config(cfg, os.path.join(folder, "config.yaml"))
    print(f"training {cfg.net_name} on {cfg.dataset} ({cfg.data_path}): {cfg.epoch_size} epochs x "
          f"{steps_per_epoch} steps of {cfg.batch_size}; run folder {folder}", flush=True)
    model.train(cfg.epoch_size, dataset, callbacks=create_callbacks(cfg, steps_per_epoch, lrs, folder),
                dataset_sink_mode=False)
    return 0


if __name__ == "__main__":
    run_cli(main)
