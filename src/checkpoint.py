"""Checkpoints: atomic saving with rotation, finding the one to resume, and loading with checks
that name what does not fit (for eval, resume and fine-tuning)."""
import contextlib
import logging
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import mindspore as ms
from mindspore import Parameter, nn

from src.errors import UserInputError

# Keys a training checkpoint holds besides the network: optimizer slots and counters, and the
# EMA of the weights (`ema.<parameter name>`, written by the train step with model_ema on).
OPTIMIZER_PREFIXES = ("moments.", "moment1.", "moment2.", "adam_m.", "adam_v.", "accum.", "accu_grads.", "stat.")
EMA_PREFIX = "ema."
STEP_COUNTER = "train_steps"  # the train step's count of optimizer steps (times the EMA updates)
STATE_SCALARS = {"global_step", "learning_rate", "momentum", "beta1_power", "beta2_power",
                 "scale_sense", "current_iterator_step", "last_overflow_iterator_step",
                 "epoch_num", "step_num", "top_1_accuracy", STEP_COUNTER}
CHECKPOINT_NAME = re.compile(r"^(?P<net>.+)-(?P<epoch>\d+)_(?P<step>\d+)\.ckpt$")
BEST_NAME = "best.ckpt"
MAX_LISTED = 8


def checkpoint_name(net_name: str, epoch: int, step_in_epoch: int) -> str:
    """The model zoo's naming: <net>-<epoch>_<step in epoch>.ckpt."""
    return f"{net_name}-{epoch}_{step_in_epoch}.ckpt"


def list_checkpoints(folder: str, net_name: str) -> List[Tuple[int, int, str]]:
    """(epoch, step in epoch, path) of the run's checkpoints, oldest first."""
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        match = CHECKPOINT_NAME.match(name)
        if match and match["net"] == net_name:
            found.append((int(match["epoch"]), int(match["step"]), os.path.join(folder, name)))
    return sorted(found)


def save_atomic(cell: nn.Cell, path: str, append_dict: Optional[Dict] = None) -> None:
    """Save through a hidden temporary file and a rename: a kill never leaves half a file under `path`."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".tmp-{os.getpid()}-{name}")
    try:
        ms.save_checkpoint(cell, tmp, append_dict=append_dict, crc_check=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def rotate(folder: str, net_name: str, keep: int, steps_per_epoch: int) -> List[str]:
    """Keep `keep` checkpoints: the newest end-of-epoch one (what --resume continues from) and the
    most recently written others; delete the rest. best.ckpt is not counted. Returns the deleted."""
    found = list_checkpoints(folder, net_name)
    ends = [path for _, step, path in found if step == steps_per_epoch]
    by_age = sorted((path for _, _, path in found), key=os.path.getmtime)
    removable = [path for path in by_age if path not in ends[-1:]]
    removed = removable[:max(0, len(found) - max(keep, 1))]
    for path in removed:
        os.remove(path)
    return removed


def read_checkpoint(path: str) -> Dict[str, Parameter]:
    """Read a MindSpore checkpoint; a missing, empty or corrupt file is a one-line error."""
    if not os.path.isfile(path):
        raise UserInputError(f"checkpoint not found: {path}; pass the path of an existing .ckpt file")
    if os.path.getsize(path) == 0:
        raise UserInputError(f"checkpoint {path} is empty (0 bytes); pick another checkpoint")
    try:
        with _framework_errors_silenced():
            return ms.load_checkpoint(path, crc_check=True)  # also verifies our files' CRC
    except Exception as err:  # the framework raises ValueError/RuntimeError/TypeError alike here
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserInputError(f"checkpoint {path} cannot be read (truncated, corrupt or not a MindSpore "
                             f"checkpoint: {reason[:160]}); pick another checkpoint") from None


@contextlib.contextmanager
def _framework_errors_silenced():
    """MindSpore logs an ERROR line of its own before raising; the caller reports it in one line."""
    from mindspore import log as ms_log
    logger = ms_log._get_logger()  # pylint: disable=protected-access
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def is_training_state(name: str) -> bool:
    """True for optimizer slots and training counters (of this repo's and the model zoo's checkpoints)."""
    return name in STATE_SCALARS or name.startswith(OPTIMIZER_PREFIXES + (EMA_PREFIX,))


def ema_part(params: Dict[str, Parameter]) -> Dict[str, Parameter]:
    """The EMA weights of a checkpoint under the network's own names ({} when it holds none)."""
    return {name[len(EMA_PREFIX):]: value for name, value in params.items() if name.startswith(EMA_PREFIX)}


def network_part(params: Dict[str, Parameter]) -> Dict[str, Parameter]:
    """The checkpoint without optimizer slots and training counters."""
    return {name: value for name, value in params.items() if not is_training_state(name)}


def _listed(items: Sequence[str]) -> str:
    shown = ", ".join(items[:MAX_LISTED])
    return shown + (f", ... (+{len(items) - MAX_LISTED})" if len(items) > MAX_LISTED else "")


def network_mismatches(net: nn.Cell, params: Dict[str, Parameter]) -> Dict[str, List[str]]:
    """Missing, unexpected and shape-mismatched names between `net` and a checkpoint."""
    expected = {p.name: tuple(p.shape) for p in net.get_parameters()}
    found = {name: tuple(value.shape) for name, value in network_part(params).items()}
    return {
        "missing": [name for name in expected if name not in found],
        "unexpected": [name for name in found if name not in expected],
        "shape mismatch": [f"{name} {found[name]} vs network {shape}" for name, shape in expected.items()
                           if name in found and found[name] != shape],
    }


def raise_if_mismatched(problems: Dict[str, List[str]], path: str, what: str, hint: str) -> None:
    if any(problems.values()):
        parts = [f"{kind} {len(names)} ({_listed(names)})" for kind, names in problems.items() if names]
        raise UserInputError(f"checkpoint {path} does not fit {what}: {'; '.join(parts)}; {hint}")


def load_into_network(net: nn.Cell, path: str, what: str = "the network",
                      use_ema: bool = False) -> Dict[str, Parameter]:
    """Load every network parameter from `path` (its EMA weights with `use_ema`); any mismatch is
    one error line listing names."""
    params = read_checkpoint(path)
    weights = network_part(params)
    if use_ema:
        weights = ema_part(params)
        if not weights:
            raise UserInputError(f"checkpoint {path} holds no EMA weights (ema.*): it was trained without "
                                 f"model_ema; drop --use_ema")
    raise_if_mismatched(network_mismatches(net, weights), path, what, "check net_name and class_num")
    ms.load_param_into_net(net, weights, strict_load=True)
    return params


def load_pretrained(net: nn.Cell, path: str, *, head: Sequence[str], filter_weight: bool,
                    what: str) -> List[str]:
    """Load a pre-trained backbone. With `filter_weight`, the head (`head` names) is skipped and
    keeps its fresh initialization. Returns the skipped descriptions."""
    params = network_part(read_checkpoint(path))
    skipped = []
    if filter_weight:
        skipped = [f"{name} {tuple(params[name].shape)}" for name in head if name in params]
        params = {name: value for name, value in params.items() if name not in head}
    problems = network_mismatches(net, params)
    if filter_weight:
        problems["missing"] = [name for name in problems["missing"] if name not in head]
    hint = "check net_name" if filter_weight else \
        "for a different class_num pass --filter_weight True to drop the classifier head"
    raise_if_mismatched(problems, path, what, hint)
    ms.load_param_into_net(net, params, strict_load=False)
    return skipped


def training_position(params: Dict[str, Parameter], path: str) -> Tuple[int, int]:
    """(epochs done, global step) recorded in a checkpoint written by train.py."""
    if "epoch_num" not in params or "step_num" not in params:
        raise UserInputError(f"checkpoint {path} has no training position (epoch_num/step_num): it was "
                             f"not written by this train.py; use it as --pre_trained instead")
    return int(params["epoch_num"].asnumpy()), int(params["step_num"].asnumpy())


def restore_training_state(train_network: nn.Cell, params: Dict[str, Parameter], path: str) -> None:
    """Load weights, optimizer slots and counters into the whole training cell (not the lr array,
    which the schedule recomputes)."""
    wanted = {p.name: p for p in train_network.get_parameters() if p.name != "learning_rate"}
    missing = [name for name in wanted if name not in params]
    if missing:
        raise UserInputError(f"checkpoint {path} lacks training state {_listed(missing)}: it was saved with "
                             f"another optimizer, loss scaling or model_ema; resume with the same config")
    ms.load_param_into_net(train_network, {name: params[name] for name in wanted}, strict_load=True)


def find_latest(folder: str, net_name: str, steps_per_epoch: int) -> str:
    """The newest end-of-epoch checkpoint in the run folder (what --resume continues from)."""
    candidates = [path for _, step, path in list_checkpoints(folder, net_name) if step == steps_per_epoch]
    if not candidates:
        raise UserInputError(f"no end-of-epoch checkpoint ({net_name}-<epoch>_{steps_per_epoch}.ckpt) in "
                             f"{folder} to resume from; pass --resume_ckpt, or start anew with another --output_dir")
    return candidates[-1]
