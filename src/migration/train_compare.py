"""What a training-parity run compares, and how: the MindSpore side's gradients and states read by
PyTorch's names, and the tables that judge each against PyTorch float32 with PyTorch float64's
distance to it as the rounding floor (src/migration/layer_diff.py's `judged`)."""
import math
from typing import Dict, List, Optional, Tuple

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from src.migration.convert_torch import ms_to_torch_name
from src.migration.layer_diff import FLOAT32_EPS, LayerRow, cosine, judged, relative_difference
from src.migration.torch_training import BN_TORCH_MOMENTUM, TorchSide
from src.training.checkpoint import EMA_PREFIX

# A MindSpore-vs-PyTorch difference may be this many times the float32 rounding floor of the same
# quantity (PyTorch float64 vs float32). Measured (docs/pytorch.md): correct runs gave ratios of
# 0.02-3.5 (losses, 1,229 tensors of resnet50, every layer alone) and 37 once, for one step of a
# run whose lr made it chaotic; the planted one-layer differences were 10^3-10^6.
TOLERANCE_MULTIPLE = 100.0
# MindSpore's optimizer slots -> torch.optim's state names.
OPTIMIZER_SLOTS = {"moments": "momentum_buffer", "accum": "momentum_buffer", "moment1": "exp_avg",
                   "moment2": "exp_avg_sq"}

# Optimizers whose first step moves each weight by about lr times the sign of its gradient (Adam's
# m / sqrt(v)): where MindSpore and PyTorch round a gradient near zero to opposite signs, their
# weights after step 1 part by ~2 lr while every gradient and moment is within its floor.
SIGN_STEPPED = ("Adam", "AdamW")

Row = Dict[str, object]


class Gradients(nn.Cell):
    """The loss's gradients with respect to `weights` (what the step computes before its update)."""

    def __init__(self, network: nn.Cell, weights):
        super().__init__(auto_prefix=False)
        self.network, self.weights = network, weights
        self.grad = ops.GradOperation(get_by_list=True)

    def construct(self, images, labels):
        return self.grad(self.network, self.weights)(images, labels)


def mindspore_gradients(step, net, images: np.ndarray, labels: np.ndarray, parts: int) -> Dict[str, np.ndarray]:
    """The mean gradient over the step's micro-batches by torch name, leaving every parameter
    (BatchNorm statistics too) as it was."""
    saved = {param.name: param.asnumpy().copy() for param in net.get_parameters()}
    gradients = Gradients(step.network, step.weights)
    total: Dict[str, np.ndarray] = {}
    for image_part, label_part in zip(np.split(images, parts), np.split(labels, parts)):
        for param, grad in zip(step.weights, gradients(ms.Tensor(image_part), ms.Tensor(label_part))):
            total[param.name] = total.get(param.name, 0.0) + grad.asnumpy().astype(np.float64) / parts
    for param in net.get_parameters():
        param.set_data(ms.Tensor(saved[param.name]))
    return {ms_to_torch_name(name): value for name, value in total.items()}


def mindspore_state(net) -> Dict[str, np.ndarray]:
    """Every parameter and statistic of the network by torch name, float64."""
    return {ms_to_torch_name(p.name): p.asnumpy().astype(np.float64) for p in net.get_parameters()}


def mindspore_optimizer_state(step) -> Dict[str, np.ndarray]:
    """The optimizer's slots as torch.optim names them: '<slot>.<parameter name>' -> value."""
    found = {}
    for param in step.optimizer.get_parameters():
        slot, _, name = param.name.partition(".")
        if slot in OPTIMIZER_SLOTS and name:
            found[f"{OPTIMIZER_SLOTS[slot]}.{ms_to_torch_name(name)}"] = param.asnumpy().astype(np.float64)
    return found


def mindspore_ema_state(step) -> Dict[str, np.ndarray]:
    """The step's EMA weights by torch name (empty without an EMA)."""
    if not getattr(step, "use_ema", False):
        return {}
    return {ms_to_torch_name(p.name[len(EMA_PREFIX):]): p.asnumpy().astype(np.float64) for p in step.ema_params}


def batch_statistics(before: Dict[str, np.ndarray], after: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Each BatchNorm's batch mean and (unbiased) variance of step 1, from its running averages."""
    found = {}
    for name, value in after.items():
        for field in ("running_mean", "running_var"):
            if name.endswith("." + field):
                batch_field = "batch_mean" if field == "running_mean" else "batch_var"
                found[name[:-len(field)] + batch_field] = \
                    (value - (1 - BN_TORCH_MOMENTUM) * before[name]) / BN_TORCH_MOMENTUM
    return found


def compare_tables(what: str, ms_values: Dict[str, np.ndarray], torch32: Dict[str, np.ndarray],
                   torch64: Dict[str, np.ndarray], multiple: float,
                   set_aside: Optional[Dict[str, np.ndarray]] = None) -> List[Row]:
    """One row per name: MindSpore against PyTorch float32, judged against float64's distance to it.
    `set_aside`: per name, a mask of elements not compared (MindSpore's value taken as PyTorch's),
    counted in the row's note."""
    rows = []
    for name, reference in torch32.items():
        other = ms_values.get(name)
        if other is None:
            rows.append({"what": what, "name": name, "shape": list(reference.shape), "max_abs_diff": "",
                         "rel_diff": "", "cosine": "", "floor": "", "ratio": "", "within": False,
                         "note": "missing on the MindSpore side"})
            continue
        mask = (set_aside or {}).get(name)
        note = ""
        if mask is not None and mask.shape == reference.shape and mask.any():
            other = np.where(mask, reference, other)
            note = (f"{int(mask.sum())} element(s) not compared: their step-1 gradient has opposite signs in "
                    f"MindSpore and PyTorch (rounding near zero), which a sign-stepping optimizer turns into +-lr")
        check = judged(relative_difference(reference, other), relative_difference(reference, torch64[name]),
                       multiple)
        rows.append({"what": what, "name": name, "shape": list(reference.shape),
                     "max_abs_diff": float(np.max(np.abs(reference - other))) if reference.size else 0.0,
                     "rel_diff": check["difference"], "cosine": cosine(reference, other), "floor": check["floor"],
                     "ratio": check["ratio"], "within": check["within"], "note": note})
    return rows


def opposite_signs(ms_grads: Dict[str, np.ndarray], torch_grads: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Per name, the elements whose gradient MindSpore and PyTorch give opposite signs."""
    return {name: np.sign(ms_grads[name]) * np.sign(grad) < 0
            for name, grad in torch_grads.items() if name in ms_grads and ms_grads[name].shape == grad.shape}


def step_one_rows(net, step_cell, side32: TorchSide, side64: TorchSide, torch_before: Dict[str, np.ndarray],
                  multiple: float, set_aside: Optional[Dict[str, np.ndarray]] = None) -> List[Row]:
    """After step 1: every weight and statistic (but the `set_aside` elements of the weights), the
    batch statistics and the optimizer state."""
    ms_state, state32, state64 = mindspore_state(net), side32.state(), side64.state()
    rows = compare_tables("after step 1", ms_state, state32, state64, multiple, set_aside)
    rows += compare_tables("batch statistics of step 1", batch_statistics(torch_before, ms_state),
                           batch_statistics(torch_before, state32), batch_statistics(torch_before, state64),
                           multiple)
    rows += compare_tables("optimizer state after step 1", mindspore_optimizer_state(step_cell),
                           side32.optimizer_state(), side64.optimizer_state(), multiple)
    return rows


def loss_row(step: int, lr: float, losses: Tuple[float, float, float], floor_so_far: float,
             multiple: float) -> Row:
    """A step's losses (MindSpore, PyTorch float32, float64) judged against the largest float32
    floor seen so far (rounding differences grow over steps; one step's floor can be 0 by chance)."""
    ms_loss, loss32, loss64 = losses
    difference = abs(ms_loss - loss32) / max(abs(loss32), 1e-12)
    floor = max(floor_so_far, abs(loss32 - loss64) / max(abs(loss64), 1e-12), FLOAT32_EPS)
    ratio = difference / floor if math.isfinite(difference) else float("inf")
    return {"step": step, "lr": lr, "loss_mindspore": ms_loss, "loss_torch": loss32, "loss_torch64": loss64,
            "rel_diff": difference, "floor": floor, "ratio": ratio, "within": bool(ratio <= multiple)}


def layer_table(rows: List[LayerRow]) -> List[Row]:
    """The layer finder's rows as layers.csv has them: each check's difference and ratio, and the
    worst of the layer's weight gradients."""
    table = []
    for row in rows:
        entry = {"layer": row.name, "kind": row.kind, "shape": row.shape, "status": row.status}
        for check in ("output", "input_grad", "running_mean", "running_var"):
            found = row.checks.get(check, {})
            entry[f"{check}_diff"] = found.get("difference", "")
            entry[f"{check}_ratio"] = found.get("ratio", "")
        weight_grads = {name[len("grad "):]: check for name, check in row.checks.items() if name.startswith("grad ")}
        worst = max(weight_grads.items(), key=lambda item: item[1]["ratio"], default=(None, {}))
        entry["weight_grad_worst"] = worst[0] or ""
        entry["weight_grad_diff"] = worst[1].get("difference", "")
        entry["weight_grad_ratio"] = worst[1].get("ratio", "")
        table.append(entry)
    return table
