"""THOR, the second-order optimizer of the model zoo's two Thor configs, on Ascend and GPU.

MindSpore 2.10's THOR is `nn.thor`, which first converts the network's Conv2d/Dense cells into
layers that also keep the second-order statistics (`ConvertNetUtils.convert_to_thor_net`), and a
Model turned into `ModelThor` by `ConvertModelUtils.convert_to_thor_model`, trained in dataset
sink mode. Both are documented for Ascend and GPU only; on CPU `Model.train` fails inside
MindSpore, so `optimizer: Thor` is refused there in one line.

THOR replaces this repository's training step (src/training/train_step.py) as a whole: EMA,
gradient accumulation, clipping, dynamic loss scaling and the rest are not combined with it, and
asking for them is a one-line error rather than a silent no-op. Nothing here runs at import.
"""
from typing import Any, List, Optional, Sequence

import numpy as np

from src.errors import UserInputError
from src.training.lr_schedule import create_thor_damping_schedule

THOR = "Thor"
THOR_DEVICES = ("Ascend", "GPU")
# The plain ResNets: MindSpore's Conv2d->Conv2dThor conversion drops `group`, so grouped (ResNeXt)
# convolutions would break; the zoo runs THOR on resnet50 only.
THOR_NETS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
# THOR's A/G matrices are refreshed every `frequency` steps; nn.thor wants at least 2.
MIN_FREQUENCY = 2


def thor_conflicts(cfg: Any) -> List[str]:
    """The switches of this config that THOR does not combine with, each as 'key value' (empty:
    none). A pure function of the config's values."""
    rules = [
        ("net_name", cfg.net_name not in THOR_NETS),
        ("dataset_sink_mode", not cfg.dataset_sink_mode),  # ModelThor refreshes its matrices per sink
        ("model_ema", cfg.model_ema),
        ("grad_accumulation_steps", cfg.grad_accumulation_steps != 1),
        ("clip_grad_norm", cfg.clip_grad_norm > 0),
        ("loss_scale_type", cfg.loss_scale_type == "dynamic"),  # THOR divides by one fixed scale
        ("boost_mode", cfg.boost_mode != "O0"),
        ("use_nesterov", cfg.use_nesterov),
        ("freeze_backbone", cfg.freeze_backbone),
        ("run_eval", cfg.run_eval),  # ModelThor does not evaluate while training
        # ModelThor feeds (images, labels) to the network: erasing and mixing need the training step's input stage
        ("random_erase", cfg.random_erase > 0),
        ("mixup_alpha", cfg.mixup_alpha > 0),
        ("cutmix_alpha", cfg.cutmix_alpha > 0),
        ("resume", cfg.resume),
        ("resume_ckpt", bool(cfg.resume_ckpt)),
        # THOR takes one decay value: these may only repeat weight_decay or be off
        ("norm_weight_decay", cfg.norm_weight_decay not in (0.0, cfg.weight_decay)),
        ("bias_weight_decay", cfg.bias_weight_decay not in (0.0, cfg.weight_decay)),
    ]
    return [f"{key} {getattr(cfg, key)!r}" for key, clash in rules if clash]


def check_thor(cfg: Any) -> None:
    """optimizer Thor: the device, the switches it does not combine with and its own keys, checked
    before any work (one line each)."""
    if cfg.device_target not in THOR_DEVICES:
        raise UserInputError(
            f"optimizer Thor runs on Ascend or GPU only (MindSpore 2.10's nn.thor with ModelThor; on "
            f"{cfg.device_target} its Model.train fails): pass --device_target Ascend or GPU, or --optimizer Momentum "
            f"(the zoo's resnet50_imagenet2012_config.yaml recipe)")
    conflicts = thor_conflicts(cfg)
    if conflicts:
        raise UserInputError(f"optimizer Thor replaces this repository's training step and does not combine with "
                             f"{', '.join(conflicts)}; drop them (THOR needs dataset_sink_mode True and trains one of "
                             f"{', '.join(THOR_NETS)})")
    if cfg.frequency < MIN_FREQUENCY:
        raise UserInputError(f"frequency (steps between THOR's matrix updates) must be >= {MIN_FREQUENCY}, "
                             f"got {cfg.frequency}")
    if not 0 < cfg.damping_decay <= 1:
        raise UserInputError(f"damping_decay must lie in (0, 1] (THOR's damping shrinks by it every 10 epochs), "
                             f"got {cfg.damping_decay}; the zoo uses 0.5 and 0.6")
    if cfg.lr_end_epoch < cfg.epoch_size:  # the lr curve reaches 0 at lr_end_epoch
        raise UserInputError(f"lr_end_epoch {cfg.lr_end_epoch} is before the run's end at epoch_size "
                             f"{cfg.epoch_size}; raise lr_end_epoch (the zoo trains 45 of 53, 40 of 50 epochs)")


def thor_layer_points(points: Sequence[int], is_layer: Sequence[bool]) -> List[int]:
    """Allreduce split points over the trainable parameters -> THOR's split points over its layers
    (nn.thor's `split_indices`: one A/G pair per Conv2d/Dense weight, in parameter order). Each
    point becomes the last layer whose weight is at or before it; for the zoo's ResNet50 the
    parameter points [80, 160] become its layer points [26, 53]."""
    layers = np.cumsum(np.asarray(is_layer, dtype=np.int64)) - 1  # the layer each parameter is in
    result: List[int] = []
    for point in points:
        if not 0 <= point < len(layers):
            raise UserInputError(f"split point {point} is outside the {len(layers)} trainable parameters")
        layer = int(layers[point])
        if layer >= 0 and layer not in result:
            result.append(layer)
    return result


def thor_damping(cfg: Any, steps_per_epoch: int) -> np.ndarray:
    """The per-step damping for the whole run (the config's damping_init and damping_decay)."""
    return create_thor_damping_schedule(damping_init=cfg.damping_init, damping_decay=cfg.damping_decay,
                                        steps_per_epoch=steps_per_epoch,
                                        total_steps=cfg.epoch_size * steps_per_epoch)


def create_thor_optimizer(net, *, lrs: np.ndarray, damping: np.ndarray, momentum: float, weight_decay: float,
                          decayed: Sequence[str], loss_scale: float, batch_size: int, frequency: int,
                          split_indices: Optional[List[int]]):
    """`nn.thor` over `net` (it converts `net`'s Conv2d/Dense cells in place); weight decay applies
    to the parameters named in `decayed` (kept by name: the conversion keeps the names)."""
    from mindspore import Tensor, nn

    names = set(decayed)
    # nn.thor checks types strictly, and a zoo file may write a float as an int (loss_scale: 128)
    return nn.thor(net, Tensor(lrs), Tensor(damping), float(momentum), weight_decay=float(weight_decay),
                   loss_scale=float(loss_scale), batch_size=int(batch_size),
                   decay_filter=lambda param: param.name in names, split_indices=split_indices,
                   frequency=int(frequency))


def create_thor_model(cfg: Any, net, lrs: np.ndarray, *, steps_per_epoch: int, fusion_points: Sequence[int],
                      group_size: int):
    """The model zoo's THOR training for `net` on Ascend/GPU: nn.thor with the per-step `lrs` and
    damping, the loss and a fixed loss scale, made a ModelThor. `fusion_points` are the allreduce
    split points over the trainable parameters (used with several ranks)."""
    from mindspore.train import ConvertModelUtils, Model

    from src.data.host_stage import normalization_of
    from src.data.input_stage import WithInputStage
    from src.training.loss import loss_from_config
    from src.training.optimizer import parameter_kinds
    from src.training.precision import create_loss_scale_manager, resolve_amp_level

    check_thor(cfg)
    amp_level = resolve_amp_level(cfg.amp_level, cfg.device_target)
    manager = create_loss_scale_manager(cfg.loss_scale_type, cfg.loss_scale)  # fixed or none (dynamic refused)
    loss = loss_from_config(cfg)
    kinds = parameter_kinds(net)  # before the conversion replaces the Conv2d/Dense cells
    decay_kinds = {"weight"} | {kind for kind, value in (("norm", cfg.norm_weight_decay),
                                                         ("bias", cfg.bias_weight_decay)) if value}
    params = net.trainable_params()
    split = thor_layer_points(fusion_points, [kinds.get(p.name) == "weight" for p in params]) \
        if group_size > 1 else None
    optimizer = create_thor_optimizer(
        net, lrs=lrs, damping=thor_damping(cfg, steps_per_epoch), momentum=cfg.momentum,
        weight_decay=cfg.weight_decay, decayed=[p.name for p in params if kinds.get(p.name) in decay_kinds],
        loss_scale=cfg.loss_scale if manager else 1.0, batch_size=cfg.batch_size, frequency=cfg.frequency,
        split_indices=split)
    # The documented composition: a Model with the THOR optimizer, then converted to ModelThor.
    # keep_batchnorm_fp32 follows the amp level (O2 keeps BatchNorm in float32, O3 does not).
    keep_bn = amp_level == "O2"
    # The dataset hands over uint8 NHWC batches: the network normalizes them first (no weights).
    network = WithInputStage(net, normalization_of(cfg.dataset))
    model = Model(network, loss_fn=loss, optimizer=optimizer, loss_scale_manager=manager, amp_level=amp_level,
                  keep_batchnorm_fp32=keep_bn)
    return ConvertModelUtils.convert_to_thor_model(model=model, network=network, loss_fn=loss, optimizer=optimizer,
                                                   loss_scale_manager=manager, amp_level=amp_level,
                                                   keep_batchnorm_fp32=keep_bn)
