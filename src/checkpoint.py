"""Loading checkpoints into a network with checks that name what does not fit."""
import os
from typing import Dict, List

import mindspore as ms
from mindspore import Parameter, nn

from src.errors import UserInputError

# Keys a training checkpoint holds besides the network: optimizer slots and counters.
OPTIMIZER_PREFIXES = ("moments.", "adam_m.", "adam_v.", "accum.", "moment1.", "moment2.")
OPTIMIZER_SCALARS = {"global_step", "learning_rate", "momentum", "beta1_power", "beta2_power",
                     "scale_sense", "current_iterator_step", "last_overflow_iterator_step",
                     "epoch_num", "step_num"}
MAX_LISTED = 8


def read_checkpoint(path: str) -> Dict[str, Parameter]:
    """Read a MindSpore checkpoint; a missing, empty or corrupt file is a one-line error."""
    if not os.path.isfile(path):
        raise UserInputError(f"checkpoint not found: {path}; pass --checkpoint_file_path with an existing .ckpt")
    if os.path.getsize(path) == 0:
        raise UserInputError(f"checkpoint {path} is empty (0 bytes); pick another checkpoint")
    try:
        return ms.load_checkpoint(path)
    except Exception as err:  # the framework raises ValueError/RuntimeError/TypeError alike here
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserInputError(f"checkpoint {path} cannot be read (truncated, corrupt or not a MindSpore "
                             f"checkpoint: {reason[:160]}); pick another checkpoint") from None


def _listed(items: List[str]) -> str:
    shown = ", ".join(items[:MAX_LISTED])
    return shown + (f", ... (+{len(items) - MAX_LISTED})" if len(items) > MAX_LISTED else "")


def network_mismatches(net: nn.Cell, params: Dict[str, Parameter]) -> Dict[str, List[str]]:
    """Missing, unexpected and shape-mismatched names between `net` and a checkpoint."""
    expected = {p.name: tuple(p.shape) for p in net.get_parameters()}
    found = {name: tuple(value.shape) for name, value in params.items()
             if name not in OPTIMIZER_SCALARS and not name.startswith(OPTIMIZER_PREFIXES)}
    return {
        "missing": [name for name in expected if name not in found],
        "unexpected": [name for name in found if name not in expected],
        "shape": [f"{name} {found[name]} vs network {shape}" for name, shape in expected.items()
                  if name in found and found[name] != shape],
    }


def load_into_network(net: nn.Cell, path: str, what: str = "the network") -> Dict[str, Parameter]:
    """Load every network parameter from `path`; any mismatch is one error line listing names."""
    params = read_checkpoint(path)
    problems = network_mismatches(net, params)
    if any(problems.values()):
        parts = [f"{kind} {len(names)} ({_listed(names)})" for kind, names in problems.items() if names]
        raise UserInputError(f"checkpoint {path} does not fit {what}: {'; '.join(parts)}; "
                             f"check net_name and class_num")
    ms.load_param_into_net(net, params, strict_load=True)
    return params
