"""Where a training step first goes non-finite (train_parity.py --find_nonfinite): one global step's
batch replayed on a checkpoint, MindSpore alone and in the run's own precision, micro-batch by
micro-batch and cell by cell (src/training/nonfinite.py)."""
import argparse
import glob
import json
import os

from src.config import Config
from src.dataset import host_batches
from src.errors import UserInputError
from src.migration.dumped_batches import read_batches
from src.training.checkpoint import network_from_checkpoint
from src.training.loop import replay_configured_step
from src.training.nonfinite import json_safe, write_replay
from src.training.precision import mixed_precision_network, resolve_amp_level


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


def find_nonfinite(cfg: Config, args: argparse.Namespace, log) -> int:
    """Replay global step --step's batch on --ckpt and say where it first goes non-finite. Prints
    the finding as one JSON line; returns the exit code (0 finite, 1 not)."""
    net = network_from_checkpoint(cfg.net_name, cfg.class_num, args.ckpt, convolutions=args.convolutions,
                                  compression=cfg.compression, log=log)
    mixed_precision_network(net, resolve_amp_level(cfg.amp_level, cfg.device_target))
    batch = (read_batches(args.batches, 1, cfg, first=args.step - 1) if args.batches
             else host_batches(cfg, args.rank, max(args.ranks, 1), first=args.step - 1, count=1))[0]
    result, which = replay_configured_step(cfg, net, *batch)
    path = write_replay(result, args.output_dir)
    log(f"step {args.step}{f' ({which})' if which else ''} on {args.ckpt}: {result.describe()} ({path})")
    print(json.dumps(json_safe({"ok": result.finite, "step": args.step, "rank": args.rank,
                                "ranks": max(args.ranks, 1), "ckpt": args.ckpt, "loss": result.loss,
                                "first_nonfinite_layer": result.first_layer,
                                "first_nonfinite_gradient": result.first_gradient,
                                "nonfinite_weights": len(result.non_finite_weights)}), allow_nan=False), flush=True)
    return 0 if result.finite else 1
