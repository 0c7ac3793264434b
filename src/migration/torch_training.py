"""The PyTorch side of a training-parity run: this repository's recipe written with torch.optim,
PyTorch's own loss and torch's gradient clipping, step for step what `TrainStep` does.

Where the frameworks' definitions differ, this repository follows PyTorch's and so does this side:
`Momentum` is torch's SGD with momentum (L2 decay added to the gradient, no dampening; MindSpore's
`nn.Momentum` computes the same), `SGD` with `use_nesterov` is torch's Nesterov form (MindSpore's
`nn.Momentum(use_nesterov=True)` lags it by a step, so this repository builds `nn.SGD` for it),
`AdamW` is torch's decoupled decay with bias correction. BatchNorm's momentum is the weight of the
new batch here (0.1) and of the old average in MindSpore (0.9): the same average.
Nothing here imports MindSpore.
"""
import copy
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from src.errors import UserInputError

# Optimizers PyTorch expresses exactly as this repository defines them (torch.optim, no extra code).
TORCH_OPTIMIZERS = ("Momentum", "SGD", "AdamW")
REFUSED = {
    "LARS": "torch.optim has no LARS (this repository's LARS is its own cell: src/training/optimizer.py)",
    "Adam": "MindSpore's nn.Adam adds eps before its bias correction and torch.optim.Adam after it, so the two "
            "differ where gradients are small; AdamW with --weight_decay 0 is torch's Adam in both",
    "Thor": "THOR is MindSpore's second-order optimizer; torch has no counterpart",
}

# Which definition this repository follows where the frameworks differ, said once per run.
DEFINITIONS = {
    "Momentum": "Momentum = torch.optim.SGD(momentum, weight_decay): decay added to the gradient, no dampening "
                "(MindSpore's nn.Momentum computes exactly that)",
    "SGD": "SGD = torch.optim.SGD; with use_nesterov, torch's Nesterov form (MindSpore's nn.SGD; nn.Momentum's "
           "use_nesterov lags it by a step and is not used)",
    "AdamW": "AdamW = torch.optim.AdamW: decay decoupled (w -= lr * wd * w), eps added after the bias correction "
             "(nn.Adam adds it before; this repository computes torch's step)",
}
BN_TORCH_MOMENTUM = 0.1  # this repository's BatchNorm momentum 0.9, in PyTorch's convention
BATCH_NORM_DEFINITION = ("BatchNorm momentum 0.9 here is PyTorch's 0.1 (MindSpore weights the old average, PyTorch "
                         "the new batch); both keep the unbiased batch variance")


@dataclass(frozen=True)
class EmaPlan:
    """The weight EMA's schedule in optimizer steps (as the MindSpore step's EmaSchedule has it)."""
    alpha: float
    every: int
    steps_per_epoch: int
    copy_until: int

    def weight_of_raw(self, step: int) -> float:
        """How far the average moves to the raw weights after optimizer step index `step` (0-based)."""
        if (step % self.steps_per_epoch) % self.every:
            return 0.0
        return 1.0 if step <= self.copy_until else self.alpha


@dataclass(frozen=True)
class TorchRecipe:
    """The config keys the PyTorch side needs, as plain values."""
    optimizer: str
    momentum: float = 0.9
    use_nesterov: bool = False
    weight_decay: float = 0.0
    norm_weight_decay: float = 0.0
    bias_weight_decay: float = 0.0
    label_smoothing: float = 0.0
    clip_grad_norm: float = 0.0
    accumulation_steps: int = 1
    ema: Optional[EmaPlan] = None


def check_torch_optimizer(name: str) -> None:
    """One line for an optimizer whose definition torch.optim cannot express."""
    if name in REFUSED:
        raise UserInputError(f"optimizer {name} has no PyTorch equivalent for a parity run: {REFUSED[name]}; "
                             f"compare with --optimizer {' or '.join(TORCH_OPTIMIZERS)}")
    if name not in TORCH_OPTIMIZERS:
        raise UserInputError(f"unknown optimizer '{name}'; choose one of {', '.join(TORCH_OPTIMIZERS)}")


def parameter_kinds(model) -> Dict[str, str]:
    """Parameter name -> 'weight' (conv/linear weight), 'norm' (BatchNorm affine) or 'bias' (conv/linear
    bias), by the owning module, as src/training/optimizer.py decides it for MindSpore cells."""
    from torch import nn  # noqa: PLC0415
    kinds = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for field, param in module.named_parameters(recurse=False):
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                kinds[prefix + field] = "weight" if field == "weight" else "bias"
            elif isinstance(module, nn.modules.batchnorm._BatchNorm):  # pylint: disable=protected-access
                kinds[prefix + field] = "norm"
            elif param.requires_grad:
                kinds[prefix + field] = "other"
    return kinds


def torch_param_groups(model, recipe: TorchRecipe) -> List[Dict]:
    """One torch param group per decay value: conv/linear weights, norms, biases, others (no decay)."""
    decay = {"weight": recipe.weight_decay, "norm": recipe.norm_weight_decay, "bias": recipe.bias_weight_decay,
             "other": 0.0}
    kinds = parameter_kinds(model)
    groups: Dict[float, List] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups.setdefault(decay[kinds.get(name, "other")], []).append(param)
    return [{"params": params, "weight_decay": value} for value, params in groups.items()]


def create_torch_optimizer(model, recipe: TorchRecipe, lr: float):
    """torch.optim for the recipe's optimizer over `model`'s decay groups."""
    import torch  # noqa: PLC0415
    check_torch_optimizer(recipe.optimizer)
    groups = torch_param_groups(model, recipe)
    if recipe.optimizer == "AdamW":
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    nesterov = recipe.use_nesterov and recipe.optimizer == "SGD"
    return torch.optim.SGD(groups, lr=lr, momentum=recipe.momentum, nesterov=nesterov)


def averaged_state(model) -> Dict[str, object]:
    """What the EMA averages: every parameter and BatchNorm statistic (not the batch counters)."""
    return {name: value for name, value in model.state_dict().items() if not name.endswith("num_batches_tracked")}


class TorchEma:
    """The weight EMA of `TrainStep`: a copy of every parameter and statistic, moved after each step."""

    def __init__(self, model, plan: EmaPlan):
        self.plan = plan
        self.average = {name: value.detach().clone() for name, value in averaged_state(model).items()}
        self.step = 0

    def update(self, model) -> None:
        weight = self.plan.weight_of_raw(self.step)
        self.step += 1
        if weight == 0.0:
            return
        for name, raw in averaged_state(model).items():
            self.average[name].mul_(1 - weight).add_(raw.detach() * weight)


@dataclass
class TorchSide:
    """One PyTorch training run: the model, its optimizer and EMA, in one precision."""
    model: object
    optimizer: object
    recipe: TorchRecipe
    ema: Optional[TorchEma] = None

    @classmethod
    def create(cls, model, recipe: TorchRecipe, *, double: bool = False) -> "TorchSide":
        model = copy.deepcopy(model)
        if double:
            model = model.double()
        model.train()
        ema = TorchEma(model, recipe.ema) if recipe.ema else None
        return cls(model, create_torch_optimizer(model, recipe, 0.0), recipe, ema)

    def gradients(self, images: np.ndarray, labels: np.ndarray) -> float:
        """Forward and backward over the step's micro-batches, the mean of their gradients left in
        `.grad`; returns the mean loss."""
        import torch  # noqa: PLC0415
        dtype = next(self.model.parameters()).dtype
        self.optimizer.zero_grad(set_to_none=True)
        steps = self.recipe.accumulation_steps
        total = 0.0
        for image_part, label_part in zip(np.split(images, steps), np.split(labels, steps)):
            targets = torch.from_numpy(label_part)
            targets = targets.long() if targets.ndim == 1 else targets.to(dtype)
            logits = self.model(torch.from_numpy(image_part).to(dtype))
            loss = torch.nn.functional.cross_entropy(logits, targets, label_smoothing=self.recipe.label_smoothing)
            (loss / steps).backward()
            total += float(loss.detach())
        return total / steps

    def step(self, images: np.ndarray, labels: np.ndarray, lr: float) -> Tuple[float, Dict[str, np.ndarray]]:
        """One optimizer step at learning rate `lr`; returns the loss and each parameter's gradient
        (before clipping, as numpy float64)."""
        import torch  # noqa: PLC0415
        loss = self.gradients(images, labels)
        grads = {name: p.grad.detach().double().numpy().copy() for name, p in self.model.named_parameters()
                 if p.grad is not None}
        if self.recipe.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.recipe.clip_grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self.ema:
            self.ema.update(self.model)
        return loss, grads

    def optimizer_state(self) -> Dict[str, np.ndarray]:
        """'<slot>.<parameter name>' -> value, for momentum buffers and Adam's moments."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        found = {}
        for param, slots in self.optimizer.state.items():
            for slot, value in slots.items():
                if hasattr(value, "ndim") and value.ndim > 0:
                    found[f"{slot}.{names[id(param)]}"] = value.detach().double().numpy().copy()
        return found

    def state(self) -> Dict[str, np.ndarray]:
        """Every parameter and statistic by name, float64."""
        return {name: value.detach().double().numpy().copy() for name, value in averaged_state(self.model).items()}

    def ema_state(self) -> Dict[str, np.ndarray]:
        return {name: value.double().numpy().copy() for name, value in self.ema.average.items()} if self.ema else {}
