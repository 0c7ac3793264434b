"""The training run's parts built from its config: seeding, network, schedule, train step, Model."""
import math
import random
import time
from typing import List, Optional

import mindspore as ms
import mindspore.dataset as mds
import numpy as np
from mindspore import Tensor, nn
from mindspore.train import Model

from src.compression import L1, LSQ, PRUNE, QAT, QUANTIZATIONS, SCOP, check_compression
from src.compression.lsq import start_activation_steps
from src.compression.prune import full_widths, prune_blocks, pruned_widths
from src.compression.qat import cpu_fake_quantizers
from src.compression.scop import knockoff_scores
from src.config import Config
from src.cpu_layers import all_finite_op, momentum_step_op, unscale_all_finite_op, uses_onednn
from src.dataset import create_train_input_stage, data_recipe, iter_host_batches
from src.errors import UserInputError
from src.evaluation.model_summary import format_gflops, model_summary, parameter_counts
from src.resnet import create_model
from src.training.callbacks import StageProgress
from src.training.checkpoint import compressed, load_pretrained
from src.training.distributed import check_fusion_points, fusion_split_points
from src.training.loss import create_loss, loss_from_config
from src.training.lr_schedule import create_lr_schedule, create_thor_lr_schedule, warmup_cut_short
from src.training.optimizer import check_optimizer, create_optimizer
from src.training.precision import create_loss_scale_manager, mixed_precision_network, resolve_amp_level
from src.training.thor import THOR, check_thor
from src.training.train_step import EmaSchedule, NetWithLoss, TrainStep, check_ema_decay, ema_schedule

BOOST_MODES = ("O0", "O1", "O2")


def seed_everything(seed: int) -> None:
    """One seed for MindSpore, its data pipeline, NumPy and Python (the same on every rank)."""
    ms.set_seed(seed)
    mds.config.set_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


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


def create_network(cfg: Config, log=print, convolutions: str = "mindspore") -> nn.Cell:
    """The config's network, its pre-trained weights loaded, its backbone frozen where asked, and
    with `compression` made what it trains after the float weights are in: pruned (prune, before
    this repository's CPU layers replace the nn.Conv2d cells it narrows) or quantization-aware (qat, lsq)."""
    if cfg.freeze_backbone and not cfg.pre_trained:
        raise UserInputError("freeze_backbone True trains only the head on top of pre-trained features; pass "
                             "--pre_trained CKPT (with --filter_weight True for another class_num)")
    net = float_network(cfg, log)
    if cfg.compression == PRUNE:
        prune(net, cfg.prune_ratio, image_size=cfg.train_image_size, log=log, criterion=cfg.prune_criterion)
    compressed(net, compression=cfg.compression, convolutions=convolutions)
    on_cpu = f"; on CPU {cpu_fake_quantizers()}" if cfg.device_target == "CPU" and cfg.compression in (QAT, LSQ) else ""
    if cfg.compression == QAT:
        log("compression qat: Golden Stick's SimQAT cells around every convolution and the fc head (int8 weights "
            "per channel, activations per tensor); checkpoints hold the quantization-aware network" + on_cpu)
    if cfg.compression == LSQ:
        log("compression lsq: Golden Stick's LSQ cells around every convolution and the fc head (int8, symmetric, "
            "weights per channel, activations per tensor, step sizes learned); checkpoints hold the "
            "quantization-aware network" + on_cpu)
    if cfg.freeze_backbone:
        total, trained = parameter_counts(net)
        log(f"freeze_backbone: training the head only ({trained:,} of {total:,} values); BatchNorm in "
            f"inference mode")
    return net


def float_network(cfg: Config, log=print) -> nn.Cell:
    """The config's network with its pre-trained float weights loaded, if any (MindSpore's cells)."""
    net = create_model(cfg.net_name, num_classes=cfg.class_num, conv_init=cfg.conv_init,
                       dense_init=cfg.dense_init, zero_init_residual=cfg.zero_init_residual,
                       freeze_bn=cfg.freeze_bn, freeze_backbone=cfg.freeze_backbone)
    if cfg.pre_trained:
        skipped = load_pretrained(net, cfg.pre_trained, head=["fc.weight", "fc.bias"],
                                  filter_weight=cfg.filter_weight,
                                  what=f"{cfg.net_name} with class_num {cfg.class_num}", log=log,
                                  compression=cfg.compression)
        log(f"loaded pre-trained weights from {cfg.pre_trained}"
            + (f"; skipped the head: {', '.join(skipped)}" if skipped else ""))
    return net


PRUNE_CRITERIA_WORDS = {L1: "the filters of largest L1 norm kept",
                        SCOP: "the channels of highest SCOP score kept, as a fresh run's knockoff stage scores them"}


def prune(net: nn.Cell, prune_ratio: float, *, image_size: int, log=print, criterion: str = L1) -> List[int]:
    """Prune `net` in place (src/compression/prune.py; by filter L1 norm: a scop run chooses its
    channels later, `choose_channels_by_scop`) and log one line of what it removed; a ratio that
    removes no channel at all (kept counts round to multiples of 16) is one error line."""
    full = list(full_widths(net).values())
    before = model_summary(net, image_size=image_size)
    widths = prune_blocks(net, prune_ratio)
    if widths == full:
        raise UserInputError(f"prune_ratio {prune_ratio} removes no channel (the kept counts round to multiples of "
                             f"16, here the full widths); raise --prune_ratio")
    after = model_summary(net, image_size=image_size)
    log(f"compression prune: removed {prune_ratio:g} of each residual block's inner channels ("
        f"{PRUNE_CRITERIA_WORDS[criterion]}, in multiples of 16): parameters {before['parameters']:,} -> "
        f"{after['parameters']:,}, GFLOPs {format_gflops(before['gflops'])} -> {format_gflops(after['gflops'])} "
        f"per image at {image_size} px")
    return widths


def choose_channels_by_scop(cfg: Config, net: nn.Cell, *, rank: int, group_size: int, steps_per_epoch: int,
                            log=print) -> None:
    """The channels a fresh prune_criterion scop run keeps: SCOP's knockoff stage (Golden Stick's
    cells, src/compression/scop.py) trained on a float copy of the network over this rank's first
    knockoff_epochs of batches (their gradients averaged across ranks, so every rank scores alike),
    then `net`, pruned to the same widths, given the float weights of the highest-scoring channels."""
    steps = max(1, math.ceil(cfg.knockoff_epochs * steps_per_epoch))
    lrs = create_lr_schedule("cosine", lr_init=0.0, lr_max=cfg.knockoff_lr, lr_end=0.0, total_steps=steps)
    started = time.perf_counter()  # the float copies' loads below were logged by create_network already
    scores = knockoff_scores(float_network(cfg, log=lambda _: None),
                             iter_host_batches(cfg, rank, group_size, first=0, count=steps), lrs, seed=cfg.seed,
                             loss_fn=create_loss(num_classes=cfg.class_num),
                             on_step=StageProgress("knockoff", steps, cfg.log_interval, log))
    chosen = float_network(cfg, log=lambda _: None)
    prune_blocks(chosen, cfg.prune_ratio, scores)
    values = {param.name: param for param in chosen.get_parameters()}
    for param in net.get_parameters():
        param.set_data(Tensor(values[param.name].asnumpy()))
    spread = np.concatenate(list(scores.values()))
    log(f"compression prune: SCOP's knockoff stage (Golden Stick's KfConv2d cells on MindSpore's convolutions, "
        f"{steps} steps of {cfg.batch_size} images and their knockoffs, lr {cfg.knockoff_lr:g} cosine) in "
        f"{time.perf_counter() - started:.0f} s; kept the channels of highest score |gamma| (2 kfscale - 1) in "
        f"{len(scores)} convolutions (scores {spread.min():.3g} to {spread.max():.3g})")


def start_lsq_steps(cfg: Config, net: nn.Cell, group_size: int, log=print) -> None:
    """Start the activation step sizes of a fresh LSQ run from its first training batch (rank 0's,
    on every rank, so every rank gets the same alphas; src/compression/lsq.py says why) and log
    their span."""
    batches = (images for images, _ in iter_host_batches(cfg, 0, group_size, first=0, count=1))
    alphas = start_activation_steps(net, batches)
    log(f"compression lsq: activation step sizes started from the first training batch (LSQ's 2 mean|x| / "
        f"sqrt(127), BatchNorm on the batch's statistics): alpha {min(alphas.values()):.3g} to "
        f"{max(alphas.values()):.3g} in {len(alphas)} quantizers")


def fusion_points(cfg: Config, net) -> list:
    """The allreduce fusion split points: the config's (validated) or derived from the network;
    none under compression qat or lsq (one allreduce per gradient). MindSpore 2.10 did not fuse
    Golden Stick's networks correctly: with the fake quantizers' ranges or step sizes in the network,
    two fused buckets stopped LSQ's first step ("Memory not enough ... Continuous memory conflicted")
    and silently changed QAT's forward passes (ResNet18 from a trained checkpoint on 2 ranks: a first
    loss of 6.9 instead of 0.16, non-finite in 3 steps; the tests' resnet10: 1% off); unfused, rank 0's
    first loss is the one a single process computes on its batch (tests/test_compression.py)."""
    if cfg.compression in QUANTIZATIONS:
        if cfg.all_reduce_fusion_config:
            raise UserInputError(f"compression {cfg.compression} trains with one allreduce per gradient "
                                 f"(MindSpore 2.10 fuses a quantization-aware network's gradients wrongly); "
                                 f"drop --all_reduce_fusion_config")
        return []
    sizes = [int(np.prod(p.shape)) for p in net.trainable_params()]
    if cfg.all_reduce_fusion_config:
        return check_fusion_points(cfg.all_reduce_fusion_config, len(sizes))
    return fusion_split_points(sizes)


def real_sink(cfg: Config) -> bool:
    """Sink mode that really sinks (CPU runs steps one by one whatever the flag)."""
    return cfg.dataset_sink_mode and cfg.device_target != "CPU"


def check_sink_size(cfg: Config, steps_per_epoch: int) -> None:
    """sink_size must keep an epoch what the dataset says it is."""
    if cfg.dataset_sink_mode and cfg.sink_size not in (-1, steps_per_epoch):
        raise UserInputError(f"sink_size {cfg.sink_size} would redefine an epoch; use -1 (one sink per epoch "
                             f"of {steps_per_epoch} steps)")


def check_step_keys(cfg: Config) -> None:
    """The compression, optimizer and EMA keys, checked before any work (ranges are checked at load)."""
    check_compression(cfg.compression, optimizer=cfg.optimizer, freeze_backbone=cfg.freeze_backbone,
                      pre_trained=cfg.pre_trained, prune_ratio=cfg.prune_ratio, prune_criterion=cfg.prune_criterion,
                      knockoff_epochs=cfg.knockoff_epochs, knockoff_lr=cfg.knockoff_lr)
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
    loss = loss_from_config(cfg)
    optimizer = create_optimizer(net, name=cfg.optimizer, learning_rate=lrs, weight_decay=cfg.weight_decay,
                                 momentum=cfg.momentum, norm_weight_decay=cfg.norm_weight_decay,
                                 bias_weight_decay=cfg.bias_weight_decay, use_nesterov=cfg.use_nesterov,
                                 lars_coefficient=cfg.lars_coefficient, lars_epsilon=cfg.lars_epsilon)
    # nn.Momentum's whole step in one kernel of ours (clipping needs the gradients between the two)
    one_momentum_op = ours and type(optimizer) is nn.Momentum and cfg.clip_grad_norm <= 0
    return TrainStep(NetWithLoss(mixed_precision_network(net, amp_level), loss), optimizer, net=net,
                     input_stage=input_stage,
                     loss_scale=loss_scale_manager.get_loss_scale() if loss_scale_manager else 1.0,
                     scale_update=loss_scale_manager.get_update_cell() if loss_scale_manager else None,
                     accumulation_steps=cfg.grad_accumulation_steps, micro_batch=cfg.batch_size,
                     clip_grad_norm=cfg.clip_grad_norm, ema=ema,
                     all_finite=all_finite_op() if ours else None,
                     unscale_all_finite=unscale_all_finite_op() if ours else None,
                     momentum_step=momentum_step_op(len(optimizer.parameters)) if one_momentum_op else None)


def check_boost_mode(boost_mode: str) -> str:
    """The model zoo's `boost_mode`: MindSpore's boost level for Model (O0: off)."""
    if boost_mode not in BOOST_MODES:
        raise UserInputError(f"unknown boost_mode '{boost_mode}'; choose one of {', '.join(BOOST_MODES)}")
    return boost_mode


def create_ema_twin(cfg: Config, net: nn.Cell, convolutions: str = "mindspore") -> nn.Cell:
    """A second network like `net` (pruned to its widths, or quantization-aware, as the run's
    compression has it), in the same precision, that evaluation loads the EMA weights into."""
    twin = create_model(cfg.net_name, num_classes=cfg.class_num)
    widths = pruned_widths(twin, {param.name: param for param in net.get_parameters()})
    compressed(twin, compression=cfg.compression, convolutions=convolutions,
               widths=widths if cfg.compression == PRUNE else None)
    mixed_precision_network(twin, network_amp_level(cfg, twin))
    return twin
