"""The two sides of a training-parity run, built from one config: the MindSpore network and the
PyTorch model holding one initial state, the lr schedule compressed into the run's steps, the EMA
plan and the PyTorch recipe (src/migration/torch_training.py)."""
import argparse
from typing import Dict, Optional, Tuple

import mindspore as ms
import numpy as np

from src.config import Config
from src.errors import UserInputError
from src.migration.convert_torch import ms_to_torch_name, torch_to_ms_name
from src.migration.parity import build_torch_model, read_pth_state, resolve_factory
from src.migration.torch_training import EmaPlan, TorchRecipe
from src.resnet import create_model
from src.training.loss import label_smoothing
from src.training.lr_schedule import create_lr_schedule
from src.training.train_step import ema_schedule


def compressed_schedule(cfg: Config, steps: int) -> Tuple[np.ndarray, int]:
    """The config's lr schedule with its epochs compressed into `steps` steps; and the warmup steps."""
    per_epoch = steps / cfg.epoch_size
    warmup = max(1, round(cfg.warmup_epochs * per_epoch)) if cfg.warmup_epochs > 0 else 0
    lrs = create_lr_schedule(cfg.lr_decay_mode, lr_init=cfg.lr_init, lr_max=cfg.lr_max, lr_end=cfg.lr_end,
                             total_steps=steps, warmup_steps=min(warmup, steps),
                             milestones=[round(epoch * per_epoch) for epoch in cfg.lr_decay_epochs],
                             gamma=cfg.lr_decay_factor, power=cfg.lr_poly_power)
    return lrs, warmup


def ema_plan(cfg: Config, steps: int, warmup: int) -> Optional[EmaPlan]:
    """train.py's EMA (its alpha for the config's run), over `steps` steps as one epoch."""
    if not cfg.model_ema:
        return None
    full = ema_schedule(decay=cfg.model_ema_decay, every=cfg.model_ema_steps, world_size=1,
                        batch_size=cfg.batch_size, accumulation_steps=cfg.grad_accumulation_steps,
                        epochs=cfg.epoch_size, warmup_epochs=0, steps_per_epoch=steps)
    return EmaPlan(alpha=full.alpha, every=full.every, steps_per_epoch=steps, copy_until=warmup)


def torch_recipe(cfg: Config, ema: Optional[EmaPlan]) -> TorchRecipe:
    """The config's recipe keys as the PyTorch side takes them."""
    return TorchRecipe(optimizer=cfg.optimizer, momentum=cfg.momentum, use_nesterov=cfg.use_nesterov,
                       weight_decay=cfg.weight_decay, norm_weight_decay=cfg.norm_weight_decay,
                       bias_weight_decay=cfg.bias_weight_decay,
                       label_smoothing=label_smoothing(cfg),
                       clip_grad_norm=cfg.clip_grad_norm, accumulation_steps=cfg.grad_accumulation_steps, ema=ema)


def torch_state_of(net) -> Dict[str, object]:
    """The MindSpore network's weights as a PyTorch state dict (with BatchNorm batch counters)."""
    import torch  # noqa: PLC0415
    state = {}
    for param in net.get_parameters():
        name = ms_to_torch_name(param.name)
        state[name] = torch.from_numpy(param.asnumpy().copy())
        if name.endswith(".running_var"):
            state[name[:-len("running_var")] + "num_batches_tracked"] = torch.tensor(0, dtype=torch.int64)
    return state


def load_torch_state(net, state: Dict[str, object]) -> None:
    """Copy a PyTorch state dict into the MindSpore network by name (every parameter must be there)."""
    values = {torch_to_ms_name(key): value for key, value in state.items() if torch_to_ms_name(key)}
    missing = [param.name for param in net.get_parameters() if param.name not in values]
    if missing:
        raise UserInputError(f"the PyTorch network has no {ms_to_torch_name(missing[0])} (and {len(missing) - 1} "
                             f"more); it must be torchvision-structured like {type(net).__name__}")
    for param in net.get_parameters():
        value = values[param.name].detach().float().numpy()
        if tuple(value.shape) != tuple(param.shape):
            raise UserInputError(f"{ms_to_torch_name(param.name)} is {list(value.shape)} in PyTorch, "
                                 f"{list(param.shape)} here; check --arch and class_num")
        param.set_data(ms.Tensor(value.copy()))


def create_sides(cfg: Config, args: argparse.Namespace):
    """The MindSpore network and the PyTorch model, holding one initial state (`--pth` converted, or
    the network's seeded initialization copied), and the PyTorch factory's spec."""
    net = create_model(cfg.net_name, num_classes=cfg.class_num, conv_init=cfg.conv_init, dense_init=cfg.dense_init,
                       zero_init_residual=cfg.zero_init_residual, convolutions=args.convolutions)
    spec, factory = resolve_factory(args.torch_model or f"src.migration.torch_resnet:{cfg.net_name}", cfg.net_name)
    state = read_pth_state(args.pth) if args.pth else torch_state_of(net)
    model = build_torch_model(spec, factory, state, cfg.class_num).train()
    load_torch_state(net, model.state_dict())
    return net, model, spec
