"""Where a run continues from, the checks that a run folder and checkpoint fit the run, and the
mark of a run whose end is done."""
import json
import os
import shlex
from typing import Optional, Sequence, Tuple

from mindspore.train import Model

from src.collective import rank_sum
from src.config import Config, read_yaml
from src.errors import UserInputError
from src.files import write_atomic
from src.training.checkpoint import (
    find_latest,
    list_checkpoints,
    network_mismatches,
    network_params,
    raise_if_mismatched,
    read_checkpoint,
    restore_training_state,
    training_position,
)
from src.training.factory import real_sink

# Written last by a run's end (src/training/loop.py, end_run): a relaunch with --resume True that
# finds it beside the last checkpoint has nothing left to do.
FINISHED_NAME = "finished.json"


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
                    mid_epoch: bool, relaunch: bool = False) -> Tuple[int, int]:
    """Restore the whole training state from `path`; returns (epochs done, global step). A
    `relaunch` (--resume True, which found `path` in the run folder) takes the run's last checkpoint
    too: a run killed after it still has its end to do. Any other complete checkpoint is refused."""
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
    if epochs_done >= epoch_size and not (relaunch and step == epoch_size * steps_per_epoch):
        raise UserInputError(f"checkpoint {path} is at epoch {epochs_done} of {epoch_size}: the run is "
                             f"complete; raise --epoch_size to train on")
    restore_training_state(model.train_network, params, path)
    return epochs_done, step


def mark_finished(folder: str, step: int, epoch: int) -> None:
    """Say in the run folder that the run's end (after its last checkpoint, at global `step`) is done."""
    write_atomic(os.path.join(folder, FINISHED_NAME), json.dumps({"epoch": epoch, "step": step}) + "\n")


def finished_here(folder: str, step: int) -> bool:
    """Whether the run folder says its end after global `step` is done (an older mark, of a run whose
    --epoch_size was raised since, does not count)."""
    path = os.path.join(folder, FINISHED_NAME)
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle).get("step") == step
    except (OSError, ValueError, AttributeError):  # none yet, or not ours: the end is done again
        return False


def run_finished(folder: str, step: int, group_size: int) -> bool:
    """Whether every rank finds the run finished after global `step`: with several ranks all of them
    or none skip the end (its evaluation is collective); a rank that misses the mark (a kill before
    node-local folders all got it) has them all do it again, which rewrites equal files."""
    return rank_sum(int(finished_here(folder, step)), group_size) == group_size


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


def best_top1(folder: str) -> float:
    """The top-1 stored in the run's best.ckpt, so a resumed run keeps the real best."""
    path = os.path.join(folder, "best.ckpt")
    if not os.path.isfile(path):
        return -1.0
    return float(read_checkpoint(path)["top_1_accuracy"].asnumpy())
