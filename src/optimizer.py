"""Optimizers with weight decay on convolution and dense weights only.

Which parameters decay is decided by the cell that owns them (Conv2d/Dense weight), not by
matching substrings of names, so BatchNorm gamma/beta and every bias stay undecayed.
"""
from typing import Dict, List, Sequence, Union

import numpy as np
from mindspore import Parameter, Tensor, nn

from src.errors import UserInputError

OPTIMIZERS = ("Momentum", "Adam")


def decayed_parameter_names(net: nn.Cell) -> List[str]:
    """Names of the weights of every Conv2d and Dense cell in the network."""
    return [cell.weight.name for _, cell in net.cells_and_names()
            if isinstance(cell, (nn.Conv2d, nn.Dense))]


def param_groups(net: nn.Cell, weight_decay: float) -> List[Dict]:
    """Two groups: conv/dense weights with `weight_decay`, every other trainable parameter without."""
    decayed = set(decayed_parameter_names(net))
    params: Sequence[Parameter] = net.trainable_params()
    with_decay = [p for p in params if p.name in decayed]
    without_decay = [p for p in params if p.name not in decayed]
    return [{"params": with_decay, "weight_decay": weight_decay},
            {"params": without_decay, "weight_decay": 0.0},
            {"order_params": params}]


def create_optimizer(net: nn.Cell, *, name: str, learning_rate: Union[float, np.ndarray],
                     weight_decay: float = 0.0, momentum: float = 0.9,
                     loss_scale: float = 1.0) -> nn.Optimizer:
    """Momentum (SGD) or Adam over `net`'s trainable parameters with decay groups."""
    lr = Tensor(learning_rate) if isinstance(learning_rate, np.ndarray) else learning_rate
    groups = param_groups(net, weight_decay)
    if name == "Momentum":
        return nn.Momentum(groups, learning_rate=lr, momentum=momentum, loss_scale=loss_scale)
    if name == "Adam":
        return nn.Adam(groups, learning_rate=lr, loss_scale=loss_scale)
    raise UserInputError(f"unknown optimizer '{name}'; choose one of {', '.join(OPTIMIZERS)}")
