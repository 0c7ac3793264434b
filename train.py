"""Train a ResNet on CIFAR-10 or an ImageNet-style folder: standalone or data-parallel.

    python train.py --config_path config/resnet50_cifar10.yaml --data_path /data/cifar-10-batches-bin
    python train.py --config_path ... --resume True          # continue the run in its run folder
    bash scripts/run_distribute_train.sh DATASET_PATH CONFIG_PATH --workers 8
    python train.py --help                                   # every config key, its type and default
"""
from src.openmp import set_openmp_environment

set_openmp_environment()  # before MindSpore is imported (it loads OpenMP, which reads it once)

import os
import random
import shlex
import sys
import tempfile
from typing import Iterator, List, Optional, Sequence, Tuple

import mindspore as ms
import mindspore.dataset as mds
import numpy as np
from mindspore.train import Model

from src.config import Config, load_config, read_yaml, run_dir, save_config
from src.cpu_convolution import all_finite_op, choose_convolutions, unscale_all_finite_op, uses_onednn
from src.cpu_convolution import set_threads as set_convolution_threads
from src.data.bad_samples import bad_sample_limit, raise_if_too_many, scan_unreadable
from src.data.host_stage import host_input_stage
from src.data.image_decode import partial_decoder
from src.dataset import (
    Augmentation,
    create_dataset,
    create_eval_dataset,
    create_source,
    create_train_input_stage,
    normalization_of,
    set_start_epoch,
)
from src.device import available_cores, cap_workers, init_device, kernel_threads
from src.errors import UserInputError, run_cli
from src.files import remove_stale_temporaries
from src.loss import create_loss
from src.lr_schedule import create_lr_schedule, create_thor_lr_schedule, warmup_cut_short
from src.resnet import create_model, probe_layers
from src.training.board import Board, batch_picture, target_captions
from src.training.callbacks import (
    CheckpointSaver,
    EvalMonitor,
    FinalState,
    ProfilerMonitor,
    RecordPlotter,
    StepCounter,
    TrainMonitor,
)
from src.training.checkpoint import (
    BEST_NAME,
    find_latest,
    list_checkpoints,
    load_into_network,
    load_pretrained,
    network_mismatches,
    network_params,
    raise_if_mismatched,
    read_checkpoint,
    restore_training_state,
    training_position,
)
from src.training.distributed import (
    all_gather_ints,
    all_reduce_sum,
    check_fusion_points,
    check_output_storage,
    check_resume_agreement,
    fusion_split_points,
    init_distributed,
    launcher_device_id,
    local_rank_count,
    set_data_parallel,
    writes_run_folder,
)
from src.training.faults import DivergedError, DivergenceGuard, GracefulStop, TrainingStopped, divergence_hints
from src.training.model_summary import model_summary, parameter_bytes, parameter_counts, summary_line
from src.training.nonfinite import replay_micro_batches, write_replay
from src.training.optimizer import check_optimizer, create_optimizer
from src.training.precision import create_loss_scale_manager, mixed_precision_network, resolve_amp_level
from src.training.report import class_names_for, evaluate_with_report, save_report
from src.training.run_record import RunRecord
from src.training.step_time import StepClock, input_bound_hints
from src.training.thor import THOR, check_thor, create_thor_model
from src.training.train_step import EmaSchedule, NetWithLoss, TrainStep, check_ema_decay, ema_schedule

BOOST_MODES = ("O0", "O1", "O2")


def seed_everything(seed: int) -> None:
    """One seed for MindSpore, its data pipeline, NumPy and Python (the same on every rank)."""
    ms.set_seed(seed)
    mds.config.set_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def data_recipe(cfg: Config) -> Augmentation:
    """The training data recipe's switches from the config (keys of the same names)."""
    return Augmentation(auto_augment=cfg.auto_augment, ra_num_ops=cfg.ra_num_ops, ra_magnitude=cfg.ra_magnitude,
                        augmix_severity=cfg.augmix_severity, random_erase=cfg.random_erase,
                        mixup_alpha=cfg.mixup_alpha, cutmix_alpha=cfg.cutmix_alpha, ra_reps=cfg.ra_reps)


def create_train_dataset(cfg: Config, rank: int, group_size: int, folder: str, *, start_epoch: int = 0,
                         skip_batches: int = 0, warn: bool = True):
    """The training data from `start_epoch` on (each epoch without its first `skip_batches`
    batches); unreadable samples are replaced and recorded in `folder` (the run folder), and warned
    about unless `warn` is False (a second pipeline over the training's draws). One batch feeds one
    optimizer step: grad_accumulation_steps micro-batches of batch_size."""
    batch = cfg.batch_size * cfg.grad_accumulation_steps
    return create_dataset(cfg.dataset, cfg.data_path, training=True, batch_size=batch,
                          image_size=cfg.train_image_size, class_num=cfg.class_num,
                          num_parallel_workers=cfg.num_parallel_workers, worker_kind=cfg.data_worker_kind,
                          num_shards=group_size, shard_id=rank, seed=cfg.seed, start_epoch=start_epoch,
                          augmentation=data_recipe(cfg),
                          interpolation=cfg.interpolation, antialias=cfg.antialias,
                          skip_samples=skip_batches * batch,
                          bad_sample_file=os.path.join(folder, f"bad_samples_rank{rank}.tsv"),
                          max_bad_samples=cfg.max_bad_samples, bad_sample_warnings=warn)


def iter_host_batches(cfg: Config, rank: int, group_size: int, *, first: int,
                      count: Optional[int]) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
    """This rank's training batches of global steps first..first+count-1 (0-based; count None: to the
    end of that epoch), one at a time, through the input stage's host computation: float32 NCHW
    images, and int labels or soft targets. Every draw is a function of (seed, epoch, index), so
    they are the training's own batches."""
    recipe, normalization = data_recipe(cfg), normalization_of(cfg.dataset)
    given = 0
    with tempfile.TemporaryDirectory() as scratch:  # its record of unreadable samples: the training warns
        batches = create_train_dataset(cfg, rank, group_size, scratch, warn=False)
        per_epoch = batches.get_dataset_size()
        epoch, skip = divmod(first, per_epoch)
        count = per_epoch - skip if count is None else count
        while given < count:
            if (epoch, skip) != (0, 0):
                batches = create_train_dataset(cfg, rank, group_size, scratch, start_epoch=epoch, skip_batches=skip,
                                               warn=False)
            iterator = batches.create_tuple_iterator(num_epochs=1, output_numpy=True)
            for columns in iterator:
                images, labels, erase, mix = (list(columns) + [None, None])[:4]
                yield host_input_stage(images, labels, erase, mix, normalization=normalization,
                                       num_classes=cfg.class_num, mixes=recipe.mixes)
                given += 1
                if given == count:
                    break
            iterator.stop()
            epoch, skip = epoch + 1, 0
            batches = None  # the next epoch is a new pipeline


def host_batches(cfg: Config, rank: int, group_size: int, *, first: int,
                 count: Optional[int]) -> List[Tuple[np.ndarray, np.ndarray]]:
    """`iter_host_batches` as a list (a few steps' batches: the parity tools)."""
    return list(iter_host_batches(cfg, rank, group_size, first=first, count=count))


def steps_per_epoch_of(cfg: Config, rank: int = 0, group_size: int = 1) -> int:
    """The training steps of one epoch for this rank (the pipeline's size; nothing is read)."""
    with tempfile.TemporaryDirectory() as scratch:
        return create_train_dataset(cfg, rank, group_size, scratch).get_dataset_size()


def check_data(cfg: Config, log) -> None:
    """--check_data: open and decode every training image once; list the unreadable ones, and stop
    when they are more than max_bad_samples."""
    source = create_source(cfg.dataset, cfg.data_path, training=True)
    bad = scan_unreadable(source, workers=cfg.num_parallel_workers)
    for name, reason in bad:
        print(f"unreadable: {name} ({reason})", file=sys.stderr, flush=True)
    limit = bad_sample_limit(cfg.max_bad_samples, len(source))
    log(f"check_data: {len(bad)} of {len(source)} training images unreadable (max_bad_samples {limit})")
    raise_if_too_many([name for name, _ in bad], limit, "all listed above")


def create_schedule(cfg: Config, steps_per_epoch: int, log=print) -> np.ndarray:
    """The per-step learning rates of the whole run (THOR's own curve for optimizer Thor)."""
    cut_short = warmup_cut_short(int(cfg.warmup_epochs * steps_per_epoch), cfg.epoch_size * steps_per_epoch)
    if cut_short and cfg.optimizer != THOR:
        log(cut_short)
    if cfg.optimizer == THOR:
        return create_thor_lr_schedule(lr_init=cfg.lr_init, lr_decay=cfg.lr_decay, lr_end_epoch=cfg.lr_end_epoch,
                                       steps_per_epoch=steps_per_epoch, total_steps=cfg.epoch_size * steps_per_epoch)
    return create_lr_schedule(
        cfg.lr_decay_mode, lr_init=cfg.lr_init, lr_max=cfg.lr_max, lr_end=cfg.lr_end,
        total_steps=cfg.epoch_size * steps_per_epoch,
        warmup_steps=int(cfg.warmup_epochs * steps_per_epoch),
        milestones=[int(epoch * steps_per_epoch) for epoch in cfg.lr_decay_epochs],
        gamma=cfg.lr_decay_factor, power=cfg.lr_poly_power)


def create_network(cfg: Config, log=print, convolutions: str = "mindspore"):
    if cfg.freeze_backbone and not cfg.pre_trained:
        raise UserInputError("freeze_backbone True trains only the head on top of pre-trained features; pass "
                             "--pre_trained CKPT (with --filter_weight True for another class_num)")
    net = create_model(cfg.net_name, num_classes=cfg.class_num, conv_init=cfg.conv_init,
                       dense_init=cfg.dense_init, zero_init_residual=cfg.zero_init_residual,
                       freeze_bn=cfg.freeze_bn, freeze_backbone=cfg.freeze_backbone, convolutions=convolutions)
    if cfg.pre_trained:
        skipped = load_pretrained(net, cfg.pre_trained, head=["fc.weight", "fc.bias"],
                                  filter_weight=cfg.filter_weight,
                                  what=f"{cfg.net_name} with class_num {cfg.class_num}", log=log)
        log(f"loaded pre-trained weights from {cfg.pre_trained}"
            + (f"; skipped the head: {', '.join(skipped)}" if skipped else ""))
    if cfg.freeze_backbone:
        total, trained = parameter_counts(net)
        log(f"freeze_backbone: training the head only ({trained:,} of {total:,} values); BatchNorm in "
            f"inference mode")
    return net


def fusion_points(cfg: Config, net) -> list:
    """The allreduce fusion split points: the config's (validated) or derived from the network."""
    sizes = [int(np.prod(p.shape)) for p in net.trainable_params()]
    if cfg.all_reduce_fusion_config:
        return check_fusion_points(cfg.all_reduce_fusion_config, len(sizes))
    return fusion_split_points(sizes)


def real_sink(cfg: Config) -> bool:
    """Sink mode that really sinks (CPU runs steps one by one whatever the flag)."""
    return cfg.dataset_sink_mode and cfg.device_target != "CPU"


def resume_checkpoint(cfg: Config, folder: str, steps_per_epoch: int, log) -> Optional[str]:
    """The checkpoint to continue from: resume_ckpt, or the newest in the run folder with --resume
    (in real sink mode the newest at a sink boundary, that is, an epoch end)."""
    if cfg.resume_ckpt:
        return cfg.resume_ckpt
    if not cfg.resume:
        return None
    newest = find_latest(folder, cfg.net_name, steps_per_epoch)
    if newest is None:
        check_relaunch_folder(cfg, folder)
        log(f"resume: no checkpoint in {folder} yet, so the run starts from the beginning there")
        return None
    if not real_sink(cfg):
        return newest
    boundary = find_latest(folder, cfg.net_name, steps_per_epoch, mid_epoch=False)
    if boundary != newest:
        log(f"dataset_sink_mode: resuming from the last sink boundary {boundary}, not the mid-epoch {newest} "
            f"(resume with --dataset_sink_mode False to continue from it exactly)")
    return boundary


# Keys that may differ between two launches of one run: how to resume, where the config came from,
# which device a scheduler gave.
LAUNCH_KEYS = ("resume", "resume_ckpt", "config_path", "device_id")


def check_relaunch_folder(cfg: Config, folder: str) -> None:
    """A run folder without checkpoints that --resume starts over in must hold nothing of another
    run: its config.yaml, if any (a launch killed before its first checkpoint leaves one), must be
    this config."""
    path = os.path.join(folder, "config.yaml")
    if not os.path.isfile(path):
        return
    saved, now = read_yaml(path), cfg.to_dict()
    changed = sorted(key for key in set(saved) | set(now)
                     if key not in LAUNCH_KEYS and saved.get(key) != now.get(key))
    if changed:
        key, more = changed[0], f", and {len(changed) - 1} more key(s)" if len(changed) > 1 else ""
        raise UserInputError(f"run folder {folder} holds another run (its config.yaml has {key}: {saved.get(key)!r}, "
                             f"this one {now.get(key)!r}{more}); relaunch it with its own command, or pick another "
                             f"--output_dir")


def check_fresh_run_folder(folder: str, net_name: str) -> None:
    """A new run never overwrites another run's checkpoints or record."""
    if list_checkpoints(folder, net_name) or os.path.exists(os.path.join(folder, "metrics.csv")):
        raise UserInputError(f"run folder {folder} already holds a run; continue it with --resume True, "
                             f"or pick another --output_dir")


def resume_position(path: str, net, model: Model, steps_per_epoch: int, epoch_size: int,
                    mid_epoch: bool) -> Tuple[int, int]:
    """Restore the whole training state from `path`; returns (epochs done, global step)."""
    params = read_checkpoint(path)
    if network_params(params, path)[1]:
        raise UserInputError(f"checkpoint {path} has the model zoo's names: its optimizer state cannot be resumed "
                             f"here; start from its weights with --pre_trained {path}")
    raise_if_mismatched(network_mismatches(net, params), path, "this network", "resume with the same config")
    epochs_done, step = training_position(params, path)
    if not epochs_done * steps_per_epoch <= step < (epochs_done + 1) * steps_per_epoch:
        raise UserInputError(f"checkpoint {path} is at step {step}, which is not in epoch {epochs_done + 1} of "
                             f"{steps_per_epoch} steps; the batch size or dataset changed: resume with the "
                             f"config the run was started with")
    if step != epochs_done * steps_per_epoch and not mid_epoch:
        raise UserInputError(f"checkpoint {path} is mid-epoch (step {step}); dataset_sink_mode can resume only "
                             f"from an epoch end: pass --dataset_sink_mode False, or an end-of-epoch checkpoint")
    if epochs_done >= epoch_size:
        raise UserInputError(f"checkpoint {path} is at epoch {epochs_done} of {epoch_size}: the run is "
                             f"complete; raise --epoch_size to train on")
    restore_training_state(model.train_network, params, path)
    return epochs_done, step


def check_sink_size(cfg: Config, steps_per_epoch: int) -> None:
    if cfg.dataset_sink_mode and cfg.sink_size not in (-1, steps_per_epoch):
        raise UserInputError(f"sink_size {cfg.sink_size} would redefine an epoch; use -1 (one sink per epoch "
                             f"of {steps_per_epoch} steps)")


def check_step_keys(cfg: Config) -> None:
    """The optimizer and EMA keys, checked before any work (ranges are checked at load)."""
    if cfg.optimizer == THOR:  # its own training path, Ascend/GPU only
        check_thor(cfg)
        return
    check_optimizer(cfg.optimizer, use_nesterov=cfg.use_nesterov, momentum=cfg.momentum,
                    lars_coefficient=cfg.lars_coefficient, lars_epsilon=cfg.lars_epsilon)
    if cfg.model_ema:
        check_ema_decay(cfg.model_ema_decay)


def create_train_model(cfg: Config, net, lrs: np.ndarray, *, steps_per_epoch: int, group_size: int) -> Model:
    """The training step around `net`, run by a Model."""
    ema = ema_schedule(decay=cfg.model_ema_decay, every=cfg.model_ema_steps, world_size=group_size,
                       batch_size=cfg.batch_size, accumulation_steps=cfg.grad_accumulation_steps,
                       epochs=cfg.epoch_size, warmup_epochs=int(cfg.warmup_epochs),
                       steps_per_epoch=steps_per_epoch) if cfg.model_ema else None
    input_stage = create_train_input_stage(cfg.dataset, data_recipe(cfg), cfg.class_num)
    step = create_train_step(cfg, net, lrs, ema=ema, input_stage=input_stage)
    return Model(step, boost_level=check_boost_mode(cfg.boost_mode))


def network_amp_level(cfg: Config, net) -> str:
    """MindSpore's amp level for `net`: O0 where our CPU layers run (they choose their own precision)."""
    return "O0" if uses_onednn(net) else resolve_amp_level(cfg.amp_level, cfg.device_target)


def create_train_step(cfg: Config, net, lrs: np.ndarray, *, ema: Optional[EmaSchedule], input_stage) -> TrainStep:
    """The training step around `net`: the input stage, loss, mixed precision, loss scaling,
    accumulation, clipping, optimizer and the EMA `ema` (None: off)."""
    amp_level = network_amp_level(cfg, net)
    ours = uses_onednn(net)  # our kernels check (and unscale) the gradients in one pass
    loss_scale_manager = create_loss_scale_manager(cfg.loss_scale_type, cfg.loss_scale)
    loss = create_loss(num_classes=cfg.class_num,
                       label_smooth_factor=cfg.label_smooth_factor if cfg.use_label_smooth else 0.0)
    optimizer = create_optimizer(net, name=cfg.optimizer, learning_rate=lrs, weight_decay=cfg.weight_decay,
                                 momentum=cfg.momentum, norm_weight_decay=cfg.norm_weight_decay,
                                 bias_weight_decay=cfg.bias_weight_decay, use_nesterov=cfg.use_nesterov,
                                 lars_coefficient=cfg.lars_coefficient, lars_epsilon=cfg.lars_epsilon)
    return TrainStep(NetWithLoss(mixed_precision_network(net, amp_level), loss), optimizer, net=net,
                     input_stage=input_stage,
                     loss_scale=loss_scale_manager.get_loss_scale() if loss_scale_manager else 1.0,
                     scale_update=loss_scale_manager.get_update_cell() if loss_scale_manager else None,
                     accumulation_steps=cfg.grad_accumulation_steps, micro_batch=cfg.batch_size,
                     clip_grad_norm=cfg.clip_grad_norm, ema=ema,
                     all_finite=all_finite_op() if ours else None,
                     unscale_all_finite=unscale_all_finite_op() if ours else None)


def check_boost_mode(boost_mode: str) -> str:
    """The model zoo's `boost_mode`: MindSpore's boost level for Model (O0: off)."""
    if boost_mode not in BOOST_MODES:
        raise UserInputError(f"unknown boost_mode '{boost_mode}'; choose one of {', '.join(BOOST_MODES)}")
    return boost_mode


def create_ema_twin(cfg: Config, convolutions: str = "mindspore"):
    """A second network, in the same precision, that evaluation loads the EMA weights into."""
    twin = create_model(cfg.net_name, num_classes=cfg.class_num, convolutions=convolutions)
    mixed_precision_network(twin, network_amp_level(cfg, twin))
    return twin


def create_callbacks(cfg: Config, *, net, model: Model, folder: str, rank: int, writer: bool, group_size: int,
                     steps_per_epoch: int, lrs: np.ndarray, first_step: int, eval_dataset,
                     record: Optional[RunRecord], board: Optional[Board], log, bad_samples,
                     argv: Sequence[str], local_ranks: int = 1, convolutions: str = "mindspore") -> list:
    """Logging, evaluation, checkpoints, the run record and profiling; files from the `writer`
    ranks only (rank 0, or each node's first rank with node-local storage).
    The step clock's two halves enclose the rest (the time between them is the wait for data);
    the divergence guard comes next (nothing after it sees NaN weights at an epoch end), the
    stop-signal handler last but the clock (it stops after the step's or the epoch's other work)."""
    ema_params = model.train_network.ema_params if cfg.model_ema else None
    clock = StepClock()
    guard = DivergenceGuard(patience=cfg.nan_patience, steps_per_epoch=steps_per_epoch, lrs=lrs,
                            skips_overflow=cfg.loss_scale_type == "dynamic", first_step=first_step,
                            hints=divergence_hints(clip_grad_norm=cfg.clip_grad_norm,
                                                  loss_scale_type=cfg.loss_scale_type))
    hints = input_bound_hints(workers=cfg.num_parallel_workers, worker_kind=cfg.data_worker_kind,
                              cores_per_process=available_cores() / max(1, local_ranks),
                              jpeg_folder=cfg.dataset != "cifar10", native_decoder=partial_decoder() is not None)
    callbacks = [clock.start, guard,
                 TrainMonitor(steps_per_epoch=steps_per_epoch, total_steps=len(lrs),
                              global_batch=cfg.batch_size * cfg.grad_accumulation_steps * group_size, lrs=lrs,
                              log_interval=cfg.log_interval, first_step=first_step, record=record, log=log,
                              bad_samples=bad_samples.count if bad_samples else None, clock=clock,
                              input_bound_hints=hints, sink_queue=real_sink(cfg))]
    if eval_dataset is not None:
        callbacks.append(EvalMonitor(net=net, ema_net=create_ema_twin(cfg, convolutions) if cfg.model_ema else None,
                                     ema_params=ema_params, dataset=eval_dataset, num_classes=cfg.class_num,
                                     group_size=group_size, epoch_size=cfg.epoch_size, steps_per_epoch=steps_per_epoch,
                                     eval_start_epoch=cfg.eval_start_epoch, eval_interval=cfg.eval_interval,
                                     best_folder=folder if cfg.save_best_ckpt and writer else None,
                                     best_top1=best_top1(folder) if first_step else -1.0, record=record, log=log))
    saver = None
    if writer:
        saver = CheckpointSaver(folder=folder, net_name=cfg.net_name, steps_per_epoch=steps_per_epoch,
                                epoch_size=cfg.epoch_size, save_epochs=cfg.save_checkpoint_epochs,
                                save_steps=cfg.save_checkpoint_steps, keep=cfg.keep_checkpoint_max,
                                first_step=first_step, periodic=cfg.save_checkpoint,
                                before_save=guard.check_weights, log=log)
        callbacks += [saver] + ([RecordPlotter(record)] if cfg.plot_curves else [])
    if cfg.enable_profiling:
        callbacks.append(ProfilerMonitor(folder=os.path.join(folder, "profiler", f"rank{rank}"),
                                         device_target=cfg.device_target, steps=cfg.profile_steps, clock=clock,
                                         board=board, log=log, first_step=first_step))
    callbacks.append(FinalState(net=net, ema_params=ema_params, folder=folder, rank=rank, first_step=first_step))
    callbacks.append(graceful_stop(cfg, steps_per_epoch=steps_per_epoch, first_step=first_step, saver=saver,
                                   record=record, group_size=group_size, log=log, argv=argv))
    callbacks.append(clock.stop)
    return callbacks


def graceful_stop(cfg: Config, *, steps_per_epoch: int, first_step: int, saver: Optional[CheckpointSaver],
                  record: Optional[RunRecord], group_size: int, log, argv: Sequence[str]) -> GracefulStop:
    """The stop-signal handler. With several ranks, they agree after every step on whether to stop
    (one small allreduce), and wait for the writers' checkpoints before they exit."""
    def agree(flag: int) -> int:
        if group_size == 1:
            return flag
        return int(all_reduce_sum(np.array([flag], dtype=np.float64))[0])

    def barrier() -> None:
        agree(0)

    return GracefulStop(steps_per_epoch=steps_per_epoch, first_step=first_step,
                        save=saver.save_now if saver else (lambda *args: None), agree=agree, barrier=barrier,
                        finish=record.plot if record else (lambda: None), resume_hint=resume_command(cfg, argv),
                        sink_mode=real_sink(cfg), log=log)


def resume_command(cfg: Config, argv: Sequence[str]) -> str:
    """The command line that continues this run."""
    if cfg.run_distribute:
        return "the same launch command with --resume True"
    kept, skip_value = [], False
    for arg in argv:
        if skip_value:
            skip_value = False
            continue
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if name in ("resume", "resume_ckpt"):
            skip_value = "=" not in arg
            continue
        kept.append(arg)
    return shlex.join(["python", "train.py", *kept, "--resume", "True"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = load_config(argv, prog="train.py")
    check_step_keys(cfg)
    check_output_storage(cfg.output_storage)
    local_ranks = local_rank_count(cfg.run_distribute, cfg.device_num)
    convolutions, convolutions_note = choose_convolutions(
        cfg.cpu_convolution, device_target=cfg.device_target,
        amp_level=resolve_amp_level(cfg.amp_level, cfg.device_target), optimizer=cfg.optimizer,
        cpu_amp_dtype=cfg.cpu_amp_dtype, threads=kernel_threads(local_ranks),
        probe_layers=probe_layers(cfg.net_name, cfg.train_image_size, cfg.batch_size))
    threads = init_device(cfg.device_target, mode_name=cfg.mode_name,
                          device_id=launcher_device_id(cfg.device_id) if cfg.run_distribute else cfg.device_id,
                          processes_per_node=local_ranks, cap_cpu_isa=convolutions == "mindspore")
    if convolutions != "mindspore":
        set_convolution_threads(threads)
    rank, group_size = init_distributed(cfg.run_distribute, cfg.device_num)
    seed_everything(cfg.seed)
    folder = run_dir(cfg)
    writer = writes_run_folder(rank, local_ranks, cfg.output_storage)
    log = print if rank == 0 else (lambda message: print(f"[rank {rank}] {message}", flush=True))
    cfg.num_parallel_workers, workers_note = cap_workers(cfg.num_parallel_workers, local_ranks)
    for note in cfg.notes + [line for line in (workers_note, convolutions_note) if line]:
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
    if cfg.optimizer == THOR:
        log(f"optimizer Thor: MindSpore's nn.thor and ModelThor in dataset sink mode, matrices refreshed every "
            f"{cfg.frequency} steps; this repository's training step (EMA, accumulation, clipping) is not used")
        model = create_thor_model(cfg, net, lrs, steps_per_epoch=steps_per_epoch, fusion_points=split_points,
                                  group_size=group_size)
    else:
        model = create_train_model(cfg, net, lrs, steps_per_epoch=steps_per_epoch, group_size=group_size)

    # Everything that can be wrong with the input is checked above; only now is anything written.
    resume_from = resume_checkpoint(cfg, folder, steps_per_epoch, log)
    start_epoch = first_step = 0
    if resume_from:
        start_epoch, first_step = resume_position(resume_from, net, model, steps_per_epoch, cfg.epoch_size,
                                                  mid_epoch=not real_sink(cfg))
    elif writer and not cfg.resume:
        check_fresh_run_folder(folder, cfg.net_name)
    if group_size > 1 and (cfg.resume or cfg.resume_ckpt):
        check_resume_agreement(all_gather_ints(first_step if resume_from else -1, rank, group_size),
                               local_ranks, folder)
    set_start_epoch(dataset, start_epoch)
    record = board = None
    if writer:
        os.makedirs(folder, exist_ok=True)
        removed = remove_stale_temporaries(folder)
        if removed:
            log(f"removed {len(removed)} temporary file(s) left by an interrupted run: {', '.join(removed)}")
        save_config(cfg, os.path.join(folder, "config.yaml"))
        if cfg.tensorboard:
            board = Board(folder, resume_step=first_step if resume_from else None)
        record = RunRecord(folder, resume_step=first_step if resume_from else None, board=board)
        if board and not resume_from:
            start_board(cfg, board, dataset, rank=rank, group_size=group_size)
    dataset.bad_samples.reset()
    callbacks = create_callbacks(cfg, net=net, model=model, folder=folder, rank=rank, writer=writer,
                                 group_size=group_size,
                                 steps_per_epoch=steps_per_epoch, lrs=lrs, first_step=first_step,
                                 eval_dataset=eval_dataset, record=record, board=board, log=log,
                                 bad_samples=dataset.bad_samples, argv=argv, local_ranks=local_ranks,
                                 convolutions=convolutions)

    log(summary_line(cfg.net_name, dict(counted, checkpoint_mb=parameter_bytes(model.train_network) / 2**20),
                     "training checkpoint (weights and optimizer state)"))
    micro_batches = f" x {cfg.grad_accumulation_steps} micro-batches" if cfg.grad_accumulation_steps > 1 else ""
    log(f"training {cfg.net_name} on {cfg.dataset} ({cfg.data_path}): epochs {start_epoch + 1}..{cfg.epoch_size} x "
        f"{steps_per_epoch} steps of {cfg.batch_size}{micro_batches} x {group_size} rank(s); amp "
        f"{resolve_amp_level(cfg.amp_level, cfg.device_target)}; run folder {folder}"
        + (f"; EMA every {cfg.model_ema_steps} steps, alpha {model.train_network.ema_alpha.asnumpy():.6g}"
           if cfg.model_ema else "")
        + (f"; resumed from {resume_from} at global step {first_step}" if resume_from else ""))
    if cfg.dataset != "cifar10" and partial_decoder() is None:
        log("note: JPEGs are decoded with Pillow (slower): the partial decoder src/data/native/libjpeg_crop.so is not "
            "built; run bash scripts/setup_env.sh (it needs cc and libjpeg-dev)")
    if cfg.dataset_sink_mode and cfg.device_target == "CPU":
        log("dataset_sink_mode: MindSpore has no CPU sink, so steps run one by one (logs stay per step)")
    next(callback for callback in callbacks if isinstance(callback, GracefulStop)).install()
    try:
        if first_step > start_epoch * steps_per_epoch:
            start_epoch = train_rest_of_epoch(cfg, model, callbacks, rank=rank, group_size=group_size, folder=folder,
                                              first_step=first_step, steps_per_epoch=steps_per_epoch)
            set_start_epoch(dataset, start_epoch)
        if start_epoch < cfg.epoch_size:
            model.train(cfg.epoch_size, dataset, callbacks=callbacks, dataset_sink_mode=cfg.dataset_sink_mode,
                        sink_size=cfg.sink_size if cfg.dataset_sink_mode else -1, initial_epoch=start_epoch)
        if eval_dataset is not None:
            monitor = next(callback for callback in callbacks if isinstance(callback, EvalMonitor))
            report_best(cfg, net, eval_dataset, folder=folder, rank=rank, writer=writer, group_size=group_size,
                        log=log, board=board, step=cfg.epoch_size * steps_per_epoch,
                        evaluated=monitor.best_evaluation if group_size == 1 else None)
        if board:
            board.finished(cfg.epoch_size * steps_per_epoch)
    except TrainingStopped as stopped:
        return stopped.exit_code
    except DivergedError as diverged:
        if diverged.step is None:
            raise
        where = replay_divergence(cfg, net, diverged.step, rank=rank, group_size=group_size, folder=folder)
        raise DivergedError(f"{diverged}; {where}", step=diverged.step) from None
    finally:
        if board:
            board.close()
    return 0


def replay_divergence(cfg: Config, net, step: int, *, rank: int, group_size: int, folder: str) -> str:
    """Replay global step `step` cell by cell on the weights before it (the train step did not apply
    it): where it first went non-finite, also written to nonfinite_rank<r>.json in the run folder."""
    try:
        images, labels = host_batches(cfg, rank, group_size, first=step - 1, count=1)[0]
        loss = create_loss(num_classes=cfg.class_num,
                           label_smooth_factor=cfg.label_smooth_factor if cfg.use_label_smooth else 0.0)
        result, which = replay_micro_batches(net, loss, images, labels, parts=cfg.grad_accumulation_steps,
                                             loss_scale=cfg.loss_scale if cfg.loss_scale_type != "none" else 1.0)
        path = write_replay(result, folder, f"nonfinite_rank{rank}.json")
    except Exception as err:  # pylint: disable=broad-except  # the divergence message must survive
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"the replay of step {step} failed ({reason})"
    others = " (the other ranks' batches: their nonfinite_rank<r>.json)" if result.finite and group_size > 1 else ""
    return f"replayed step {step}{f' ({which})' if which else ''}: {result.describe()}{others} ({path})"


def start_board(cfg: Config, board: Board, dataset, *, rank: int, group_size: int) -> None:
    """A new run's TensorBoard record begins with its config (the HParams table, with the last
    evaluation figures beside it) and its first training batch as the network sees it."""
    board.hyperparameters(cfg.to_dict(), metrics=["eval/top_1", "eval/top_5", "eval/loss", "eval/ece", "train/loss"])
    pixels, targets = first_batch(cfg, rank, group_size)
    names = class_names_for(dataset.sample_source, cfg.class_num)
    board.image("data/first_batch", batch_picture(pixels, target_captions(targets, names)), 0)


# The first training batch's picture shows this many of its images.
PICTURE_IMAGES = 32


def first_batch(cfg: Config, rank: int, group_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """The first training batch after the whole recipe (policies, erasing, mixing), back in uint8 RGB
    pixels [N, H, W, 3], with its targets. Read from a second pipeline: every draw is a function of
    (seed, epoch, index), so it is the training's batch (its unreadable samples, replaced the same
    way, are recorded by the training's own pipeline)."""
    images, targets = host_batches(cfg, rank, group_size, first=0, count=1)[0]
    shift, scale = normalization_of(cfg.dataset).shift_and_scale()
    pixels = images[:PICTURE_IMAGES].transpose(0, 2, 3, 1) / scale + shift
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8), targets[:PICTURE_IMAGES]


def report_best(cfg: Config, net, eval_dataset, *, folder: str, rank: int, writer: bool, group_size: int,
                log, board: Optional[Board] = None, step: int = 0, evaluated: Optional[tuple] = None) -> None:
    """The evaluation report of the run's best.ckpt (of the final weights when there is none) into
    <run folder>/report/, written where the run folder is (by each node's writer with node-local
    storage). Every rank evaluates its shard; each reads best.ckpt from its node's run folder.
    `evaluated`: the (figures, report) of the best.ckpt this process saved, evaluated when it was
    saved (one process only: the ranks of a data-parallel run evaluate together, so all or none)."""
    best = os.path.join(folder, BEST_NAME)
    if evaluated is not None:
        write_best_report(cfg, *evaluated, eval_dataset, folder=folder, weights=best, log=log, board=board, step=step)
        return
    found = float(os.path.isfile(best))
    if group_size > 1:  # also a barrier: rank 0 has finished writing best.ckpt
        found = all_reduce_sum(np.array([found]))[0]
    if 0 < found < group_size:
        log(f"no report: {best} is not visible to every rank (put the run folder on a shared file system)")
        return
    if found:  # into the trained network (training is over): no second network to build
        load_into_network(net, best, what=f"{cfg.net_name} with class_num {cfg.class_num}", log=log,
                          use_ema=cfg.model_ema)  # best.ckpt follows the EMA when there is one
    result, report = evaluate_with_report(net, eval_dataset, num_classes=cfg.class_num, group_size=group_size)
    if writer:
        write_best_report(cfg, result, report, eval_dataset, folder=folder,
                          weights=best if found else f"the final weights of {folder}", log=log, board=board, step=step)


def write_best_report(cfg: Config, result: dict, report, eval_dataset, *, folder: str, weights: str, log,
                      board: Optional[Board], step: int) -> None:
    """Log the figures of `weights` and write their report into <run folder>/report/."""
    log(f"report of {weights}: top-1 {result['top_1_accuracy']:.4f} top-5 {result['top_5_accuracy']:.4f} "
        f"ECE {result['ece']:.4f} on {result['samples']} images, in {os.path.join(folder, 'report')}")
    written = save_report(os.path.join(folder, "report"), report, source=eval_dataset.sample_source,
                          num_classes=cfg.class_num, title=f"{cfg.net_name} on {cfg.dataset}: {weights}", log=log)
    for path in written:
        if board and path.endswith(".png"):
            board.picture_file(f"report/{os.path.splitext(os.path.basename(path))[0]}", path, step)


def train_rest_of_epoch(cfg: Config, model: Model, callbacks: list, *, rank: int, group_size: int, folder: str,
                        first_step: int, steps_per_epoch: int) -> int:
    """Resuming mid-epoch: train the batches of the interrupted epoch after `first_step` (a dataset
    of their own, since MindSpore wants every epoch of one dataset equally long); returns the
    number of epochs done."""
    epoch = first_step // steps_per_epoch
    rest = create_train_dataset(cfg, rank, group_size, folder, start_epoch=epoch,
                                skip_batches=first_step - epoch * steps_per_epoch)
    model.train(epoch + 1, rest, callbacks=callbacks, dataset_sink_mode=False, initial_epoch=epoch)
    for callback in callbacks:  # MindSpore counts steps from 1 again in every train() call
        if isinstance(callback, StepCounter):
            callback.first_step = (epoch + 1) * steps_per_epoch
    return epoch + 1


def best_top1(folder: str) -> float:
    """The top-1 stored in the run's best.ckpt, so a resumed run keeps the real best."""
    path = os.path.join(folder, "best.ckpt")
    if not os.path.isfile(path):
        return -1.0
    return float(read_checkpoint(path)["top_1_accuracy"].asnumpy())


if __name__ == "__main__":
    run_cli(main)
