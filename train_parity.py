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
import json
import os
import sys
from typing import Optional, Sequence, Tuple

from src.config import Config, load_config
from src.dataset import host_batches
from src.errors import OneLineParser, UserInputError, run_cli
from src.migration.convert_torch import import_torch
from src.migration.dumped_batches import check_batch, check_batch_folder, read_batches
from src.migration.layer_diff import first_differing
from src.migration.learning import learn_side_by_side
from src.migration.nonfinite_replay import check_replay_ranks, find_nonfinite
from src.migration.torch_training import check_torch_optimizer
from src.migration.train_compare import TOLERANCE_MULTIPLE, layer_table
from src.migration.train_report import chaotic_note, parity_summary, save_final, verdict_line, write_tables
from src.migration.train_steps import locate_difference, run_steps
from src.resnet import ARCHS, ZOO_NETWORKS
from src.runtime import set_up_runtime
from src.training.factory import seed_everything
from src.training.nonfinite import json_safe
from src.training.train_step import check_ema_decay


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
    """Refuse, in one line and before any work, what cannot be compared or replayed."""
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, cfg = parse_args(list(sys.argv[1:] if argv is None else argv))
    check_request(args, cfg)
    log = print
    # The convolutions the run would use (float32 here: the comparison is float32's, see below).
    runtime = set_up_runtime(cfg.device_target, cpu_convolution=cfg.cpu_convolution, optimizer=cfg.optimizer,
                             mode_name="PYNATIVE" if args.pynative or args.find_nonfinite else "GRAPH")
    args.convolutions, args.convolutions_note = runtime.convolutions, runtime.note
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
    layers = locate_difference(cfg, args, model, batches, first_bad, before_bad, log)
    differing = first_differing(layers)
    write_tables(args.output_dir, tables, layer_table(layers), plot=cfg.plot_curves)
    save_final(args.output_dir, net, step_cell, side32.model.state_dict())
    note = chaotic_note(tables["steps"])
    if note:
        log(note)
    summary = parity_summary(tables, arch=cfg.net_name, mode="PYNATIVE" if args.pynative else "GRAPH",
                             multiple=args.multiple, first_bad=first_bad, differing=differing,
                             output_dir=args.output_dir)
    log(verdict_line(summary, differing))
    print(json.dumps(json_safe(summary), allow_nan=False), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    run_cli(main)
