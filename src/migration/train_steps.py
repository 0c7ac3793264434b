"""A training-parity run's steps: this repository's `TrainStep` and PyTorch (float32 and float64) in
lockstep on the same batches, every step's loss and step 1's tensors judged as they go; then, where
something differs (or when asked), every layer alone on that step's batch (src/migration/layer_diff.py)."""
import argparse
import copy
from typing import Dict, List, Optional, Tuple

import mindspore as ms

from src.config import Config
from src.cpu_layers import use_onednn_convolutions
from src.migration.dumped_batches import Batch
from src.migration.layer_diff import LayerRow, find_first_difference
from src.migration.torch_training import BATCH_NORM_DEFINITION, DEFINITIONS, TorchSide
from src.migration.train_compare import (
    SIGN_STEPPED,
    Row,
    compare_tables,
    loss_row,
    mindspore_ema_state,
    mindspore_gradients,
    mindspore_state,
    opposite_signs,
    step_one_rows,
)
from src.migration.train_sides import compressed_schedule, create_sides, ema_plan, load_torch_state, torch_recipe
from src.resnet import create_model
from src.training.factory import create_train_step
from src.training.loss import label_smoothing
from src.training.train_step import EmaSchedule, ReadyInput

Tables = Dict[str, List[Row]]


def run_steps(cfg: Config, args: argparse.Namespace, batches: List[Batch],
              log) -> Tuple[Tables, Optional[int], Optional[dict], tuple]:
    """Both sides in lockstep; returns the tables, the first failing step's number and the PyTorch
    state before it (for the layer comparison), and the sides (net, step_cell, side32, model)."""
    steps = len(batches)
    net, model, spec = create_sides(cfg, args)
    lrs, warmup = compressed_schedule(cfg, steps)
    plan = ema_plan(cfg, steps, warmup)
    ema = EmaSchedule(alpha=plan.alpha, every=plan.every, steps_per_epoch=steps,
                      copy_until=plan.copy_until) if plan else None
    step_cell = create_train_step(cfg, net, lrs, ema=ema, input_stage=ReadyInput())
    step_cell.set_train(True)
    recipe = torch_recipe(cfg, plan)
    side32, side64 = TorchSide.create(model, recipe), TorchSide.create(model, recipe, double=True)
    log(f"train parity {cfg.net_name}: {steps} steps of batch {len(batches[0][0])} "
        f"({cfg.grad_accumulation_steps} micro-batch(es)), {'PYNATIVE' if args.pynative else 'GRAPH'} mode; "
        f"PyTorch {spec}; optimizer {cfg.optimizer}, lr {lrs[0]:.4g}..{lrs.max():.4g}..{lrs[-1]:.4g} "
        f"({warmup} warmup step(s))" + (f", EMA alpha {plan.alpha:.4g} every {plan.every}" if plan else "")
        + f"; layers: {args.convolutions}" + (f" ({args.convolutions_note})" if args.convolutions_note else ""))
    log(f"definitions: {DEFINITIONS[cfg.optimizer]}; {BATCH_NORM_DEFINITION}")
    tables: Tables = {"steps": [], "gradients": [], "weights": []}
    floor_so_far, first_bad, before_bad = 0.0, None, None
    log(f"{'step':>4} {'lr':>9} {'MindSpore':>12} {'PyTorch':>12} {'rel diff':>9} {'floor':>9} {'ratio':>7}")
    for number, (images, labels) in enumerate(batches, 1):
        state_before = copy.deepcopy(side32.model.state_dict()) if first_bad is None else None
        if number == 1:
            ms_grads = mindspore_gradients(step_cell, net, images, labels, cfg.grad_accumulation_steps)
            torch_before = side32.state()
        lr = float(lrs[number - 1])
        loss32, grads32 = side32.step(images, labels, lr)
        loss64, grads64 = side64.step(images, labels, lr)
        outputs = step_cell(ms.Tensor(images), ms.Tensor(labels))
        row = loss_row(number, lr, (float(outputs[0].asnumpy()), loss32, loss64), floor_so_far, args.multiple)
        floor_so_far = row["floor"]
        tables["steps"].append(row)
        log(f"{number:>4} {lr:>9.5f} {row['loss_mindspore']:>12.7f} {loss32:>12.7f} {row['rel_diff']:>9.2e} "
            f"{row['floor']:>9.2e} {row['ratio']:>7.2f}" + ("" if row["within"] else "  <- over"))
        if number == 1:
            tables["gradients"] = compare_tables("gradient", ms_grads, grads32, grads64, args.multiple)
            sign_ties = opposite_signs(ms_grads, grads32) if cfg.optimizer in SIGN_STEPPED else None
            tables["weights"] += step_one_rows(net, step_cell, side32, side64, torch_before, args.multiple, sign_ties)
            if not all(r["within"] for r in tables["gradients"] + tables["weights"]):
                first_bad = 1
        if first_bad is None and not row["within"]:
            first_bad = number
        if first_bad == number:
            before_bad = state_before
    tables["weights"] += compare_tables(f"after step {steps}", mindspore_state(net), side32.state(), side64.state(),
                                        args.multiple)
    if plan:
        tables["weights"] += compare_tables(f"EMA after step {steps}", mindspore_ema_state(step_cell),
                                            side32.ema_state(), side64.ema_state(), args.multiple)
    return tables, first_bad, before_bad, (net, step_cell, side32, model)


def compare_layers(cfg: Config, args: argparse.Namespace, model, state, batch: Batch, log) -> List[LayerRow]:
    """Every layer alone on `batch` from PyTorch's state `state`, in PYNATIVE mode; the rows."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    layer_model = copy.deepcopy(model)
    layer_model.load_state_dict(state)
    net = create_model(cfg.net_name, num_classes=cfg.class_num, initialize=False)  # PyTorch's state next
    if args.convolutions != "mindspore":  # the run's convolutions, the image's gradient too (it is compared)
        use_onednn_convolutions(net, image_gradient=True)
    load_torch_state(net, layer_model.state_dict())
    images, labels = batch
    part = len(images) // cfg.grad_accumulation_steps
    smoothing = label_smoothing(cfg)
    rows = find_first_difference(layer_model, net, images[:part], labels[:part], label_smoothing=smoothing,
                                 multiple=args.multiple)
    log(f"layers: {sum(r.status == 'ok' for r in rows)} within {args.multiple:g} x their floor, "
        f"{sum(r.differs for r in rows)} differ, {sum(r.status.startswith('not') for r in rows)} not compared")
    return rows


def locate_difference(cfg: Config, args: argparse.Namespace, model, batches: List[Batch],
                      first_bad: Optional[int], before_bad: Optional[dict], log) -> List[LayerRow]:
    """The layer rows of the first failing step (from PyTorch's state before it), of step 1 with
    --per_layer when all is within, else none."""
    if first_bad is None and not args.per_layer:
        return []
    at = first_bad or 1
    state = before_bad if first_bad is not None else copy.deepcopy(model.state_dict())
    log(f"comparing every layer alone on step {at}'s batch")
    return compare_layers(cfg, args, model, state, batches[at - 1], log)
