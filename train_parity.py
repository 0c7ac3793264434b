"""Does this repository train as PyTorch does? The same N optimizer steps in both, compared by name.

    python train_parity.py --arch resnet50 --config_path config/resnet50_imagenet2012_v2.yaml \
        --data_path data/sample/imagenet --train_image_size 64 --batch_size 8 --class_num 10 --steps 20
    python train_parity.py ... --torch_model mypackage.models:resnet50 --pth IN.pth --per_layer
    python train_parity.py ... --batches DIR           # batches dumped from your own PyTorch loader
    python train_parity.py ... --find_nonfinite --ckpt RUN/ckpt.ckpt --step 1234

One initial state (`--pth` converted, or this repository's seeded initialization copied into the
PyTorch network), the same batches (this repository's pipeline draws them once; the input stage's
host computation turns them into the float inputs and soft targets both sides get; or `--batches`),
the same recipe from the same config keys: torch.optim and PyTorch's loss on one side
(src/migration/torch_training.py), this repository's `TrainStep` on the other (GRAPH mode, or
`--pynative`). The lr schedule is the config's, compressed into the N steps (warmup takes
warmup_epochs / epoch_size of them, at least one); amp is off (both sides float32).

The tolerance is measured, not guessed: the PyTorch run is also done in float64, and every
MindSpore-vs-PyTorch difference is divided by the float32-vs-float64 difference of the same
quantity (its rounding floor); a ratio above --multiple fails. When something fails (or with
--per_layer), each layer is compared alone on that step's batch (src/migration/layer_diff.py) and
the first that differs is named. Files in --output_dir: steps.csv, gradients.csv, weights.csv,
layers.csv, loss.png (not with plot_curves False), final.ckpt, final.pth. The last stdout line is
one JSON object; exit 0 within tolerance, 1 not, 2 for bad input.
"""
from src.openmp import set_openmp_environment

set_openmp_environment()  # before MindSpore is imported (it loads OpenMP, which reads it once)

import argparse
import copy
import csv
import glob
import io
import json
import math
import os
import sys
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from src.config import Config, load_config
from src.cpu_convolution import choose_convolutions, use_onednn_convolutions
from src.cpu_convolution import set_threads as set_convolution_threads
from src.data.host_stage import host_normalize, normalization_of
from src.dataset import create_eval_dataset
from src.device import init_device
from src.errors import OneLineParser, UserInputError, run_cli
from src.files import atomic_target, write_atomic
from src.loss import create_loss
from src.lr_schedule import create_lr_schedule
from src.migration.convert_torch import import_torch, ms_to_torch_name, torch_to_ms_name
from src.migration.layer_diff import (
    FLOAT32_EPS,
    cosine,
    find_first_difference,
    first_differing,
    judged,
    relative_difference,
)
from src.migration.parity import build_torch_model, read_pth_state, resolve_factory
from src.migration.torch_training import (
    BATCH_NORM_DEFINITION,
    DEFINITIONS,
    EmaPlan,
    TorchRecipe,
    TorchSide,
    check_torch_optimizer,
)
from src.resnet import ARCHS, ZOO_NETWORKS, create_model
from src.training.checkpoint import EMA_PREFIX, load_into_network
from src.training.nonfinite import json_safe, replay_micro_batches, write_replay
from src.training.precision import mixed_precision_network, resolve_amp_level
from src.training.train_step import EmaSchedule, ReadyInput, check_ema_decay, ema_schedule
from train import (
    create_schedule,
    create_train_step,
    host_batches,
    iter_host_batches,
    seed_everything,
    steps_per_epoch_of,
)

# A MindSpore-vs-PyTorch difference may be this many times the float32 rounding floor of the same
# quantity (PyTorch float64 vs float32). Measured (docs/pytorch.md): correct runs gave ratios of
# 0.02-3.5 (losses, 1,229 tensors of resnet50, every layer alone) and 37 once, for one step of a
# run whose lr made it chaotic; the planted one-layer differences were 10^3-10^6.
TOLERANCE_MULTIPLE = 100.0
# A loss floor above this: PyTorch's own float32 and float64 runs parted (rounding amplified).
CHAOTIC_FLOOR = 1e-2
# MindSpore's optimizer slots -> torch.optim's state names.
OPTIMIZER_SLOTS = {"moments": "momentum_buffer", "accum": "momentum_buffer", "moment1": "exp_avg",
                   "moment2": "exp_avg_sq"}
BN_TORCH_MOMENTUM = 0.1  # this repository's BatchNorm momentum 0.9, in PyTorch's convention

Batch = Tuple[np.ndarray, np.ndarray]


def parse_args(argv: Sequence[str]) -> Tuple[argparse.Namespace, Config]:
    """The tool's own flags; everything else is a config key (`--config_path`, `--key value`)."""
    parser = OneLineParser(prog="python train_parity.py", description=__doc__.split("\n")[0], add_help=False)
    parser.add_argument("--arch", default=None, help="the network (default: the config's net_name)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pth", default=None, help="start from this PyTorch state dict (converted)")
    parser.add_argument("--batches", default=None, help="folder of NNNNNN_images.npy / NNNNNN_labels.npy")
    parser.add_argument("--torch_model", default=None, help="package.module:factory of the PyTorch network "
                                                            "(default: src.migration.torch_resnet:<arch>)")
    parser.add_argument("--output_dir", default="./train_parity")
    parser.add_argument("--pynative", action="store_true", help="run the MindSpore side in PYNATIVE mode")
    parser.add_argument("--per_layer", action="store_true", help="compare every layer also when all is within")
    parser.add_argument("--multiple", type=float, default=TOLERANCE_MULTIPLE)
    parser.add_argument("--find_nonfinite", action="store_true",
                        help="replay step --step on --ckpt and name where it first goes NaN/Inf")
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--step", type=int, default=1, help="the global step (1-based) whose batch is replayed")
    parser.add_argument("--ranks", type=int, default=0,
                        help="with --find_nonfinite on a data-parallel run: its number of ranks (with --rank)")
    parser.add_argument("--rank", type=int, default=0, help="the rank whose batch --find_nonfinite replays")
    parser.add_argument("--learn", type=int, default=0, metavar="EPOCHS",
                        help="train EPOCHS epochs in both frameworks per --seeds and print held-out top-1 per epoch "
                             "(default data: scikit-learn's digits)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        print("\nAny other --key value is a config key (see python train.py --help).")
        sys.exit(0)
    args, rest = parser.parse_known_args(argv)
    if args.steps < 1 or args.step < 1 or args.multiple <= 0:
        raise UserInputError("--steps and --step must be >= 1 and --multiple > 0")
    args.data_given = any(arg == "--data_path" or arg.startswith("--data_path=") for arg in rest)
    overrides = ["--net_name", args.arch] if args.arch else []
    cfg = load_config(list(rest) + overrides, prog="train_parity.py")
    return args, cfg


def check_request(args: argparse.Namespace, cfg: Config) -> None:
    if args.find_nonfinite:  # MindSpore alone: any network
        if not args.ckpt:
            raise UserInputError("--find_nonfinite replays a step on a checkpoint: pass --ckpt FILE and --step N")
        check_replay_ranks(args, cfg)
        return
    if cfg.net_name in ZOO_NETWORKS:
        raise UserInputError(f"{cfg.net_name} has no PyTorch reference (torchvision has no such network), so "
                             f"there is nothing to compare it with; choose one of {', '.join(ARCHS)}")
    if cfg.net_name not in ARCHS:
        raise UserInputError(f"unknown --arch {cfg.net_name}; choose one of {', '.join(ARCHS)}")
    check_torch_optimizer(cfg.optimizer)
    if cfg.model_ema:
        check_ema_decay(cfg.model_ema_decay)
    if args.batches:  # before the output folder is made
        check_batch_folder(args.batches, args.steps)


def check_replay_ranks(args: argparse.Namespace, cfg: Config) -> None:
    """A data-parallel run's step saw a different batch on each rank: replaying one needs the run's
    ranks and the rank (train.py wrote nonfinite_rank<r>.json beside the checkpoint for each)."""
    folder = os.path.dirname(os.path.abspath(args.ckpt))
    ranks_seen = sorted(glob.glob(os.path.join(folder, "*_rank[1-9]*.json")))
    sign = "run_distribute True" if cfg.run_distribute else (os.path.basename(ranks_seen[0]) if ranks_seen else "")
    if args.ranks == 0 and sign:
        raise UserInputError(f"{args.ckpt} is from a data-parallel run ({sign}): "
                             f"each rank's step saw its own batch; pass --ranks N (the run's ranks) and --rank R "
                             f"(the rank to replay; train.py named the failing step in nonfinite_rank<R>.json)")
    if args.ranks and not 0 <= args.rank < args.ranks:
        raise UserInputError(f"--rank {args.rank} is not a rank of --ranks {args.ranks}; choose 0..{args.ranks - 1}")


# ---------------------------------------------------------------------------------------------
# The batches.

def check_batch_folder(folder: str, steps: int) -> None:
    """A folder of dumped batches holding at least `steps` steps' images."""
    if not os.path.isdir(folder):
        raise UserInputError(f"--batches {folder} is not a folder; dump NNNNNN_images.npy and NNNNNN_labels.npy "
                             f"per step into one")
    available = len(glob.glob(os.path.join(folder, "*_images.npy")))
    if available < steps:
        raise UserInputError(f"--batches {folder} holds {available} step(s) of *_images.npy, the run needs "
                             f"{steps}; lower --steps or dump more batches")


def read_batches(folder: str, steps: int, cfg: Config, first: int = 0) -> List[Batch]:
    """Steps `first`.. of a folder of dumped batches, checked: float32 NCHW images, int64 labels
    [B] or float32 soft targets [B, class_num], one batch size divisible by grad_accumulation_steps."""
    check_batch_folder(folder, first + steps)
    found = []
    for step in range(first, first + steps):
        images_path = os.path.join(folder, f"{step:06d}_images.npy")
        labels_path = os.path.join(folder, f"{step:06d}_labels.npy")
        try:
            images, labels = np.load(images_path, allow_pickle=False), np.load(labels_path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise UserInputError(f"--batches: cannot read step {step} ({err}); each step needs "
                                 f"{step:06d}_images.npy and {step:06d}_labels.npy") from None
        check_batch(images, labels, cfg, images_path)
        found.append((images, labels))
    sizes = {len(images) for images, _ in found}
    if len(sizes) > 1:
        raise UserInputError(f"--batches {folder}: batch sizes differ between steps ({sorted(sizes)}); use one size")
    return found


def check_batch(images: np.ndarray, labels: np.ndarray, cfg: Config, where: str) -> None:
    if images.dtype != np.float32 or images.ndim != 4 or images.shape[1] != 3:
        raise UserInputError(f"{where}: images must be float32 [B, 3, H, W] (normalized NCHW), got {images.dtype} "
                             f"{list(images.shape)}")
    batch = images.shape[0]
    if labels.ndim == 1 and labels.dtype.kind in "iu":
        if labels.shape[0] != batch or labels.min() < 0 or labels.max() >= cfg.class_num:
            raise UserInputError(f"{where}: labels must be {batch} class indices in [0, {cfg.class_num}) "
                                 f"(class_num); got {labels.shape[0]} in [{labels.min()}, {labels.max()}]")
    elif labels.ndim == 2 and labels.dtype == np.float32:
        if labels.shape != (batch, cfg.class_num):
            raise UserInputError(f"{where}: soft targets must be [{batch}, {cfg.class_num}] (class_num), got "
                                 f"{list(labels.shape)}")
    else:
        raise UserInputError(f"{where}: labels must be int64 [B] or float32 soft targets [B, K], got "
                             f"{labels.dtype} {list(labels.shape)}")
    if batch % cfg.grad_accumulation_steps:
        raise UserInputError(f"{where}: batch {batch} is not divisible by grad_accumulation_steps "
                             f"{cfg.grad_accumulation_steps}")


# ---------------------------------------------------------------------------------------------
# The two sides.

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
    return TorchRecipe(optimizer=cfg.optimizer, momentum=cfg.momentum, use_nesterov=cfg.use_nesterov,
                       weight_decay=cfg.weight_decay, norm_weight_decay=cfg.norm_weight_decay,
                       bias_weight_decay=cfg.bias_weight_decay,
                       label_smoothing=cfg.label_smooth_factor if cfg.use_label_smooth else 0.0,
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
    """The MindSpore network and the PyTorch model, holding one initial state."""
    net = create_model(cfg.net_name, num_classes=cfg.class_num, conv_init=cfg.conv_init, dense_init=cfg.dense_init,
                       zero_init_residual=cfg.zero_init_residual, convolutions=args.convolutions)
    spec, factory = resolve_factory(args.torch_model or f"src.migration.torch_resnet:{cfg.net_name}", cfg.net_name)
    state = read_pth_state(args.pth) if args.pth else torch_state_of(net)
    model = build_torch_model(spec, factory, state, cfg.class_num).train()
    load_torch_state(net, model.state_dict())
    return net, model, spec


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
    return {ms_to_torch_name(p.name): p.asnumpy().astype(np.float64) for p in net.get_parameters()}


def mindspore_optimizer_state(step) -> Dict[str, np.ndarray]:
    found = {}
    for param in step.optimizer.get_parameters():
        slot, _, name = param.name.partition(".")
        if slot in OPTIMIZER_SLOTS and name:
            found[f"{OPTIMIZER_SLOTS[slot]}.{ms_to_torch_name(name)}"] = param.asnumpy().astype(np.float64)
    return found


def mindspore_ema_state(step) -> Dict[str, np.ndarray]:
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


# ---------------------------------------------------------------------------------------------
# Comparing.

def compare_tables(what: str, ms_values: Dict[str, np.ndarray], torch32: Dict[str, np.ndarray],
                   torch64: Dict[str, np.ndarray], multiple: float) -> List[Dict[str, object]]:
    """One row per name: MindSpore against PyTorch float32, judged against float64's distance to it."""
    rows = []
    for name, reference in torch32.items():
        other = ms_values.get(name)
        if other is None:
            rows.append({"what": what, "name": name, "shape": list(reference.shape), "max_abs_diff": "",
                         "rel_diff": "", "cosine": "", "floor": "", "ratio": "", "within": False,
                         "note": "missing on the MindSpore side"})
            continue
        check = judged(relative_difference(reference, other), relative_difference(reference, torch64[name]),
                       multiple)
        rows.append({"what": what, "name": name, "shape": list(reference.shape),
                     "max_abs_diff": float(np.max(np.abs(reference - other))) if reference.size else 0.0,
                     "rel_diff": check["difference"], "cosine": cosine(reference, other), "floor": check["floor"],
                     "ratio": check["ratio"], "within": check["within"], "note": ""})
    return rows


def loss_row(step: int, lr: float, losses: Tuple[float, float, float], floor_so_far: float,
             multiple: float) -> Dict[str, object]:
    """A step's losses (MindSpore, PyTorch float32, float64) judged against the largest float32
    floor seen so far (rounding differences grow over steps; one step's floor can be 0 by chance)."""
    ms_loss, loss32, loss64 = losses
    difference = abs(ms_loss - loss32) / max(abs(loss32), 1e-12)
    floor = max(floor_so_far, abs(loss32 - loss64) / max(abs(loss64), 1e-12), FLOAT32_EPS)
    ratio = difference / floor if math.isfinite(difference) else float("inf")
    return {"step": step, "lr": lr, "loss_mindspore": ms_loss, "loss_torch": loss32, "loss_torch64": loss64,
            "rel_diff": difference, "floor": floor, "ratio": ratio, "within": bool(ratio <= multiple)}


def write_csv(path: str, rows: List[Dict[str, object]]) -> None:
    """The rows as CSV, atomically; no rows: no file (not an earlier run's)."""
    if not rows:
        if os.path.exists(path):
            os.remove(path)
        return
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, text.getvalue())


def plot_losses(path: str, rows: List[Dict[str, object]]) -> None:
    """Both loss curves, and their relative difference beside the float32 floor on a log scale."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    steps = [row["step"] for row in rows]
    figure, (curves, gaps) = plt.subplots(1, 2, figsize=(10, 4))
    curves.plot(steps, [row["loss_torch"] for row in rows], "o-", label="PyTorch")
    curves.plot(steps, [row["loss_mindspore"] for row in rows], "x--", label="MindSpore")
    curves.set(xlabel="step", ylabel="loss", title="training loss")
    curves.legend()
    gaps.semilogy(steps, [max(row["rel_diff"], 1e-12) for row in rows], "x-", label="MindSpore vs PyTorch")
    gaps.semilogy(steps, [row["floor"] for row in rows], "--", label="float32 floor (vs float64)")
    gaps.set(xlabel="step", ylabel="relative difference", title="loss difference")
    gaps.legend()
    figure.subplots_adjust(wspace=0.3, bottom=0.15)
    figure.savefig(path, dpi=80)
    plt.close(figure)


# ---------------------------------------------------------------------------------------------
# The run.

def run_steps(cfg: Config, args: argparse.Namespace, batches: List[Batch], log):
    """Both sides in lockstep; returns the tables, the first failing step's number and the PyTorch
    state before it (for the layer comparison), and the sides."""
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
    tables: Dict[str, List[Dict[str, object]]] = {"steps": [], "gradients": [], "weights": []}
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
            tables["weights"] += step_one_rows(net, step_cell, side32, side64, torch_before, args.multiple)
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


def step_one_rows(net, step_cell, side32: TorchSide, side64: TorchSide, torch_before: Dict[str, np.ndarray],
                  multiple: float) -> List[Dict[str, object]]:
    """After step 1: every weight and statistic, the batch statistics and the optimizer state."""
    ms_state, state32, state64 = mindspore_state(net), side32.state(), side64.state()
    rows = compare_tables("after step 1", ms_state, state32, state64, multiple)
    rows += compare_tables("batch statistics of step 1", batch_statistics(torch_before, ms_state),
                           batch_statistics(torch_before, state32), batch_statistics(torch_before, state64),
                           multiple)
    rows += compare_tables("optimizer state after step 1", mindspore_optimizer_state(step_cell),
                           side32.optimizer_state(), side64.optimizer_state(), multiple)
    return rows


def compare_layers(cfg: Config, args: argparse.Namespace, model, state, batch: Batch, log):
    """Every layer alone on `batch` from PyTorch's state `state`, in PYNATIVE mode; the rows."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    layer_model = copy.deepcopy(model)
    layer_model.load_state_dict(state)
    net = create_model(cfg.net_name, num_classes=cfg.class_num)
    if args.convolutions != "mindspore":  # the run's convolutions, the image's gradient too (it is compared)
        use_onednn_convolutions(net, image_gradient=True)
    load_torch_state(net, layer_model.state_dict())
    images, labels = batch
    part = len(images) // cfg.grad_accumulation_steps
    smoothing = cfg.label_smooth_factor if cfg.use_label_smooth else 0.0
    rows = find_first_difference(layer_model, net, images[:part], labels[:part], label_smoothing=smoothing,
                                 multiple=args.multiple)
    log(f"layers: {sum(r.status == 'ok' for r in rows)} within {args.multiple:g} x their floor, "
        f"{sum(r.differs for r in rows)} differ, {sum(r.status.startswith('not') for r in rows)} not compared")
    return rows


def layer_table(rows) -> List[Dict[str, object]]:
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


def save_final(folder: str, net, step_cell, model_state) -> None:
    """final.ckpt (the network, and its EMA as ema.*) and final.pth, each written whole or not at all."""
    import torch  # noqa: PLC0415
    params = [{"name": p.name, "data": p} for p in net.get_parameters()]
    if getattr(step_cell, "use_ema", False):
        params += [{"name": p.name, "data": p} for p in step_cell.ema_params]
    for name, save in (("final.ckpt", lambda path: ms.save_checkpoint(params, path)),
                       ("final.pth", lambda path: torch.save(model_state, path))):
        with atomic_target(os.path.join(folder, name)) as staged:
            save(staged)


def find_nonfinite(cfg: Config, args: argparse.Namespace, log) -> int:
    """Replay global step --step's batch on --ckpt and say where it first goes non-finite."""
    net = create_model(cfg.net_name, num_classes=cfg.class_num, convolutions=args.convolutions)
    load_into_network(net, args.ckpt, what=f"{cfg.net_name} with class_num {cfg.class_num}", log=log)
    mixed_precision_network(net, resolve_amp_level(cfg.amp_level, cfg.device_target))
    batch = (read_batches(args.batches, 1, cfg, first=args.step - 1) if args.batches
             else host_batches(cfg, args.rank, max(args.ranks, 1), first=args.step - 1, count=1))[0]
    loss = create_loss(num_classes=cfg.class_num,
                       label_smooth_factor=cfg.label_smooth_factor if cfg.use_label_smooth else 0.0)
    result, which = replay_micro_batches(net, loss, *batch, parts=cfg.grad_accumulation_steps,
                                         loss_scale=cfg.loss_scale if cfg.loss_scale_type != "none" else 1.0)
    path = write_replay(result, args.output_dir)
    log(f"step {args.step}{f' ({which})' if which else ''} on {args.ckpt}: {result.describe()} ({path})")
    print(json.dumps(json_safe({"ok": result.finite, "step": args.step, "rank": args.rank,
                                "ranks": max(args.ranks, 1), "ckpt": args.ckpt, "loss": result.loss,
                                "first_nonfinite_layer": result.first_layer,
                                "first_nonfinite_gradient": result.first_gradient,
                                "nonfinite_weights": len(result.non_finite_weights)}), allow_nan=False), flush=True)
    return 0 if result.finite else 1


# ---------------------------------------------------------------------------------------------
# Learning side by side.

def held_out(cfg: Config) -> Iterator[Batch]:
    """The evaluation split batch by batch, normalized as both networks see it: float32 NCHW images
    and labels (read anew for each evaluation: ImageNet's does not fit in memory)."""
    for columns in create_eval_dataset(cfg).create_tuple_iterator(num_epochs=1, output_numpy=True):
        yield host_normalize(columns[0], normalization_of(cfg.dataset)), columns[1]


def top1(predict, batches: Iterable[Batch]) -> float:
    correct = total = 0
    for images, labels in batches:
        correct += int((predict(images).argmax(axis=1) == labels).sum())
        total += len(labels)
    return correct / max(total, 1)


# --learn's rule: the final epoch's mean top-1 over the seeds may differ between the frameworks by
# LEARN_SPREADS standard errors of that difference (from each side's spread over the seeds), and
# always by LEARN_FLOOR (one seed has no spread; top-1 on a few hundred images moves in steps of a
# fraction of a percent). Overlapping seed ranges are not enough: one noisy seed makes any two overlap.
LEARN_SPREADS, LEARN_FLOOR = 2.0, 0.02


def learning_verdict(runs: Dict[int, Dict[str, List[float]]]) -> Dict[str, float]:
    """The rule applied to the last epoch of every seed's curves."""
    last = {side: np.array([curves[side][-1] for curves in runs.values()]) for side in ("mindspore", "torch")}
    seeds = len(runs)
    variance = sum(float(values.var(ddof=1)) if seeds > 1 else 0.0 for values in last.values())
    standard_error = (variance / seeds) ** 0.5
    difference = abs(float(last["mindspore"].mean() - last["torch"].mean()))
    allowed = max(LEARN_SPREADS * standard_error, LEARN_FLOOR)
    return {"mindspore_mean": float(last["mindspore"].mean()), "torch_mean": float(last["torch"].mean()),
            "difference": difference, "standard_error": standard_error, "allowed": allowed,
            "ok": difference <= allowed}


def learn_one_seed(cfg: Config, args: argparse.Namespace, log) -> Dict[str, List[float]]:
    """Both frameworks from one seeded state on the same batches for --learn epochs: top-1 after
    each. Batches stream from the pipeline, as in training."""
    import torch  # noqa: PLC0415
    seed_everything(cfg.seed)
    torch.manual_seed(cfg.seed)
    net, model, _ = create_sides(cfg, args)
    per_epoch = steps_per_epoch_of(cfg)
    lrs = create_schedule(cfg, per_epoch)
    step_cell = create_train_step(cfg, net, lrs, ema=None, input_stage=ReadyInput())
    side = TorchSide.create(model, torch_recipe(cfg, None))
    curves: Dict[str, List[float]] = {"mindspore": [], "torch": []}
    for epoch in range(cfg.epoch_size):
        step_cell.set_train(True)
        for index, (images, labels) in enumerate(iter_host_batches(cfg, 0, 1, first=epoch * per_epoch, count=None)):
            side.step(images, labels, float(lrs[epoch * per_epoch + index]))
            step_cell(ms.Tensor(images), ms.Tensor(labels))
        net.set_train(False)
        side.model.eval()
        with torch.no_grad():
            curves["torch"].append(top1(lambda x: side.model(torch.from_numpy(x)).numpy(), held_out(cfg)))
        curves["mindspore"].append(top1(lambda x: net(ms.Tensor(x)).asnumpy(), held_out(cfg)))
        side.model.train()
        log(f"seed {cfg.seed} epoch {epoch + 1}: top-1 MindSpore {curves['mindspore'][-1]:.4f}, "
            f"PyTorch {curves['torch'][-1]:.4f}")
    return curves


def learn_side_by_side(cfg: Config, args: argparse.Namespace, log) -> int:
    """--learn: the recipe over several seeds in both frameworks; judged by learning_verdict."""
    import_torch()
    if not args.data_given:
        from src.data.digits_data import write_digits  # noqa: PLC0415
        cfg.data_path = write_digits(os.path.join(args.output_dir, "digits"))
        cfg.dataset, cfg.class_num, cfg.eval_dataset_path = "cifar10", 10, ""
        log(f"data: scikit-learn's digits written as CIFAR-10 binary files to {cfg.data_path}")
    cfg.epoch_size = args.learn
    runs = {}
    for seed in args.seeds:
        cfg.seed = seed
        runs[seed] = learn_one_seed(cfg, args, log)
    log(f"{'epoch':>5} {'MindSpore min..max':>20} {'PyTorch min..max':>20}")
    for epoch in range(args.learn):
        spans = {side: (min(r[side][epoch] for r in runs.values()), max(r[side][epoch] for r in runs.values()))
                 for side in ("mindspore", "torch")}
        log(f"{epoch + 1:>5} {spans['mindspore'][0]:>9.4f}..{spans['mindspore'][1]:.4f} "
            f"{spans['torch'][0]:>9.4f}..{spans['torch'][1]:.4f}")
    verdict = learning_verdict(runs)
    log(f"learn: final epoch over {len(runs)} seed(s): mean top-1 MindSpore {verdict['mindspore_mean']:.4f}, "
        f"PyTorch {verdict['torch_mean']:.4f}, difference {verdict['difference']:.4f}; allowed "
        f"{LEARN_SPREADS:g} x its standard error over the seeds ({verdict['standard_error']:.4f}), at least "
        f"{LEARN_FLOOR:g}: "
        f"{verdict['allowed']:.4f}: {'OK' if verdict['ok'] else 'FAIL'}")
    print(json.dumps({"learn": {str(seed): curves for seed, curves in runs.items()}, "verdict": verdict,
                      "ok": verdict["ok"]}), flush=True)
    return 0 if verdict["ok"] else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, cfg = parse_args(list(sys.argv[1:] if argv is None else argv))
    check_request(args, cfg)
    log = print
    # The convolutions the run would use (float32 here: the comparison is float32's, see below).
    args.convolutions, args.convolutions_note = choose_convolutions(cfg.cpu_convolution,
                                                                    device_target=cfg.device_target,
                                                                    optimizer=cfg.optimizer)
    threads = init_device(cfg.device_target, cap_cpu_isa=args.convolutions == "mindspore",
                          mode_name="PYNATIVE" if args.pynative or args.find_nonfinite else "GRAPH")
    if args.convolutions != "mindspore":
        set_convolution_threads(threads)
    seed_everything(cfg.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    if args.find_nonfinite:  # in the run's own precision
        return find_nonfinite(cfg, args, log)
    cfg.amp_level = "O0"  # both sides float32: the floor is float32's
    if args.learn:
        return learn_side_by_side(cfg, args, log)
    torch = import_torch()
    torch.manual_seed(cfg.seed)
    batches = read_batches(args.batches, args.steps, cfg) if args.batches else host_batches(cfg, 0, 1, first=0,
                                                                                             count=args.steps)
    for images, labels in batches[:1]:
        check_batch(images, labels, cfg, "the first batch")
    tables, first_bad, before_bad, (net, step_cell, side32, model) = run_steps(cfg, args, batches, log)

    layers = []
    if first_bad is not None or args.per_layer:
        at = first_bad or 1
        state = before_bad if first_bad is not None else copy.deepcopy(model.state_dict())
        log(f"comparing every layer alone on step {at}'s batch")
        layers = compare_layers(cfg, args, model, state, batches[at - 1], log)
    differing = first_differing(layers)
    out = args.output_dir
    write_csv(os.path.join(out, "steps.csv"), tables["steps"])
    write_csv(os.path.join(out, "gradients.csv"), tables["gradients"])
    write_csv(os.path.join(out, "weights.csv"), tables["weights"])
    write_csv(os.path.join(out, "layers.csv"), layer_table(layers))
    if cfg.plot_curves:
        plot_losses(os.path.join(out, "loss.png"), tables["steps"])
    save_final(out, net, step_cell, side32.model.state_dict())

    floor = tables["steps"][-1]["floor"]
    if floor > CHAOTIC_FLOOR:
        log(f"note: PyTorch's own float32 and float64 runs ended {floor:.2g} apart in the loss: this training "
            f"amplifies rounding (small batches and feature maps make BatchNorm's statistics ill-conditioned, a "
            f"high lr makes it chaotic), so differences of that size are expected and only their ratio to the "
            f"floor says something; a larger batch or image, or a lower lr_max, calms it")
    compared = tables["gradients"] + tables["weights"]
    worst = max(compared, key=lambda r: r["ratio"] if r["ratio"] != "" else float("inf"))
    beyond = [f"{r['what']}: {r['name']}" for r in compared if not r["within"]]
    ok = first_bad is None and not beyond  # every row written, the final and EMA weights too
    summary = {
        "ok": ok, "arch": cfg.net_name, "steps": len(batches), "mode": "PYNATIVE" if args.pynative else "GRAPH",
        "multiple": args.multiple, "first_bad_step": first_bad,
        "first_difference": differing.name if differing else None,
        "max_loss_ratio": max(r["ratio"] for r in tables["steps"]),
        "worst_tensor": f"{worst['what']}: {worst['name']}", "worst_tensor_ratio": worst["ratio"],
        "tensors_within": len(compared) - len(beyond), "tensors": len(compared), "tensors_beyond": beyond[:20],
        "final_loss": {"mindspore": tables["steps"][-1]["loss_mindspore"],
                       "torch": tables["steps"][-1]["loss_torch"]},
        "output_dir": out}
    if ok:
        log(f"train parity: OK: {len(batches)} steps, every loss within {args.multiple:g} x its float32 floor "
            f"(largest {summary['max_loss_ratio']:.2f} x), {summary['tensors_within']} of {summary['tensors']} "
            f"gradients/weights/states within")
    elif first_bad is None:  # every loss within, but a later weight, EMA or state is not
        log(f"train parity: FAIL: every loss within, but {len(beyond)} of {len(compared)} gradients/weights/states "
            f"beyond {args.multiple:g} x their floor: {', '.join(beyond[:5])}" + (" ..." if len(beyond) > 5 else "")
            + " (see weights.csv)")
    else:
        where = (f"first layer that differs: {differing.name} ({differing.kind}; {differing.worst()})" if differing
                 else "no single layer differs on its own (see layers.csv)")
        log(f"train parity: FAIL from step {first_bad}; {where}; {len(beyond)} of {len(compared)} "
            f"gradients/weights/states beyond")
    print(json.dumps(json_safe(summary), allow_nan=False), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    run_cli(main)
