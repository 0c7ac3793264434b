"""Optimizers and their weight-decay groups.

What decays, and by how much, is decided by the cell that owns a parameter, not by matching
substrings of names: Conv2d/Dense weights take `weight_decay`, BatchNorm gamma/beta take
`norm_weight_decay`, Conv2d/Dense biases `bias_weight_decay` (both 0 by default, as before), and
anything else does not decay. LARS's trust ratio likewise applies to Conv2d/Dense weights only.
"""
from typing import Dict, List, Tuple, Union

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from src.errors import UserInputError

OPTIMIZERS = ("Momentum", "SGD", "Adam", "AdamW", "LARS")
# torch's Nesterov form, as nn.SGD has it (nn.Momentum's use_nesterov lags it by one step)
NESTEROV_OPTIMIZERS = ("SGD", "LARS")
PARAMETER_KINDS = ("weight", "norm", "bias", "other")
_lars_gradient = ops.MultitypeFuncGraph("lars_gradient")


@_lars_gradient.register("Tensor", "Tensor", "Number", "Bool", "Tensor", "Tensor")
def _lars_gradient_tensor(coefficient, epsilon, weight_decay, trusted, weight, grad):
    """grad + decay * weight, times the trust ratio coefficient * |w| / (|g| + decay * |w| + eps)
    for the parameters LARS applies to (1 where either norm is 0)."""
    decayed = grad + weight_decay * weight if weight_decay else grad
    if not trusted:
        return decayed
    w_norm = ops.norm(weight)
    g_norm = ops.norm(grad)
    ratio = coefficient * w_norm / (g_norm + weight_decay * w_norm + epsilon)
    ratio = ops.select(ops.logical_and(w_norm > 0, g_norm > 0), ratio, ops.ones_like(ratio))
    return decayed * ratio


_decoupled_decay = ops.MultitypeFuncGraph("decoupled_decay")


@_decoupled_decay.register("Tensor", "Number", "Tensor")
def _decoupled_decay_tensor(lr, weight_decay, weight):
    if not weight_decay:
        return weight
    return ops.assign(weight, weight - lr * weight_decay * weight)


_adam_step = ops.MultitypeFuncGraph("adam_step")


@_adam_step.register("Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor",
                     "Tensor")
def _adam_step_tensor(lr, beta1, beta2, eps, correction1, correction2, weight, moment1, moment2, grad):
    """torch's Adam step: w -= lr * m_hat / (sqrt(v_hat) + eps), both moments bias-corrected."""
    m = ops.assign(moment1, moment1 * beta1 + grad * (1 - beta1))
    v = ops.assign(moment2, moment2 * beta2 + ops.square(grad) * (1 - beta2))
    step = lr * (m / correction1) / (ops.sqrt(v / correction2) + eps)
    return ops.assign(weight, weight - ops.cast(step, weight.dtype))


class AdamW(nn.Cell):
    """torch's AdamW: each weight shrinks by lr x its group's decay, then torch's bias-corrected Adam
    step moves it by the gradient alone. The state (moment1/2, beta powers, step) is that of an
    nn.Adam built without decay, so checkpoints keep their names; the step is computed here because
    nn.Adam adds eps before its bias correction (torch after it), which made its steps up to 30x
    smaller where gradients are tiny (train_parity.py found it). (MindSpore's AdamWeightDecay has no
    bias correction at all.)"""

    def __init__(self, adam: nn.Adam, *, weight_decays):
        super().__init__(auto_prefix=False)
        self.optimizer = adam
        self.parameters = adam.parameters
        self.weight_decays = tuple(weight_decays)
        self.hyper_map = ops.HyperMap()

    def construct(self, grads):
        adam = self.optimizer
        grads = adam.scale_grad(grads)
        lr = adam.get_lr()
        step = ops.assign_add(adam.global_step, adam.global_step_increase_tensor)
        beta1_power = ops.assign(adam.beta1_power, adam.beta1_power * adam.beta1)
        beta2_power = ops.assign(adam.beta2_power, adam.beta2_power * adam.beta2)
        decayed = self.hyper_map(ops.partial(_decoupled_decay, lr), self.weight_decays, self.parameters)
        grads = ops.depend(grads, (decayed, step))
        return self.hyper_map(ops.partial(_adam_step, lr, adam.beta1, adam.beta2, adam.eps, 1 - beta1_power,
                                          1 - beta2_power), self.parameters, adam.moment1, adam.moment2, grads)


class LARS(nn.Cell):
    """Layer-wise adaptive rate scaling around momentum SGD built without weight decay: each
    gradient gets its group's weight decay, and conv/dense weights their trust ratio, before SGD
    applies it. (MindSpore's nn.LARS needs the LARSUpdate kernel, which CPU lacks.)"""

    def __init__(self, momentum: nn.SGD, *, weight_decays, trusted, coefficient: float, epsilon: float):
        super().__init__(auto_prefix=False)
        self.optimizer = momentum
        self.parameters = momentum.parameters
        self.weight_decays = tuple(weight_decays)
        self.trusted = tuple(trusted)
        self.coefficient = Tensor(coefficient, ms.float32)
        self.epsilon = Tensor(epsilon, ms.float32)
        self.hyper_map = ops.HyperMap()

    def construct(self, grads):
        grads = self.hyper_map(ops.partial(_lars_gradient, self.coefficient, self.epsilon), self.weight_decays,
                               self.trusted, self.parameters, grads)
        return self.optimizer(grads)


def parameter_kinds(net: nn.Cell) -> Dict[str, str]:
    """Parameter name -> 'weight' (conv/dense weight), 'norm' (BatchNorm gamma/beta) or 'bias'
    (conv/dense bias), by the owning cell; other parameters are absent."""
    kinds = {}
    for _, cell in net.cells_and_names():
        if isinstance(cell, (nn.Conv2d, nn.Dense)):
            kinds[cell.weight.name] = "weight"
            if cell.bias is not None:
                kinds[cell.bias.name] = "bias"
        elif isinstance(cell, nn.BatchNorm2d):
            kinds[cell.gamma.name] = kinds[cell.beta.name] = "norm"
    return kinds


def decayed_parameter_names(net: nn.Cell) -> List[str]:
    """Names of the weights of every Conv2d and Dense cell in the network."""
    return [name for name, kind in parameter_kinds(net).items() if kind == "weight"]


def param_groups(net: nn.Cell, weight_decay: float, norm_weight_decay: float = 0.0,
                 bias_weight_decay: float = 0.0) -> List[Dict]:
    """One group per distinct decay value (conv/dense weights' group first), then the order of
    `net`'s trainable parameters. With the default 0 for norms and biases: two groups, conv/dense
    weights with `weight_decay` and every other trainable parameter without."""
    kinds = parameter_kinds(net)
    decay = {"weight": weight_decay, "norm": norm_weight_decay, "bias": bias_weight_decay, "other": 0.0}
    params = net.trainable_params()
    groups: Dict[float, List] = {}
    for kind in PARAMETER_KINDS:
        members = [p for p in params if kinds.get(p.name, "other") == kind]
        if members:
            groups.setdefault(decay[kind], []).extend(members)
    return [{"params": members, "weight_decay": value} for value, members in groups.items()] + \
        [{"order_params": params}]


def check_optimizer(name: str, *, use_nesterov: bool, momentum: float, lars_coefficient: float,
                    lars_epsilon: float) -> None:
    """The optimizer keys, checked before any work (one-line errors naming the key)."""
    if name == "Thor":  # the model zoo's two THOR configs: train.py builds it (src/training/thor.py)
        raise UserInputError("optimizer Thor is MindSpore's nn.thor with ModelThor, which train.py builds on Ascend or "
                             "GPU (src/training/thor.py); it is not one of this training step's optimizers")
    if name not in OPTIMIZERS:
        raise UserInputError(f"unknown optimizer '{name}'; choose one of {', '.join(OPTIMIZERS)}")
    if use_nesterov and name not in NESTEROV_OPTIMIZERS:
        raise UserInputError(f"use_nesterov applies to {', '.join(NESTEROV_OPTIMIZERS)}, not {name}; "
                             f"drop --use_nesterov")
    if use_nesterov and momentum <= 0:
        raise UserInputError("use_nesterov needs momentum > 0; raise --momentum (e.g. 0.9)")
    # epsilon 0 is safe (the trust ratio is 1 where a norm is 0) and is what the model zoo's Boost config sets
    if name == "LARS" and (lars_coefficient <= 0 or lars_epsilon < 0):
        raise UserInputError(f"LARS needs lars_coefficient > 0 and lars_epsilon >= 0, got {lars_coefficient} and "
                             f"{lars_epsilon}")


def create_optimizer(net: nn.Cell, *, name: str, learning_rate: Union[float, np.ndarray],
                     weight_decay: float = 0.0, momentum: float = 0.9, loss_scale: float = 1.0,
                     norm_weight_decay: float = 0.0, bias_weight_decay: float = 0.0, use_nesterov: bool = False,
                     lars_coefficient: float = 0.001, lars_epsilon: float = 1e-5) -> nn.Cell:
    """Momentum, SGD (torch's momentum SGD), Adam, AdamW (torch's: decoupled decay) or LARS (around
    momentum SGD) over `net`'s trainable parameters with decay groups. `loss_scale` is divided out of
    the gradients by the optimizer (1.0 when the train step unscales them itself)."""
    check_optimizer(name, use_nesterov=use_nesterov, momentum=momentum, lars_coefficient=lars_coefficient,
                    lars_epsilon=lars_epsilon)
    lr = Tensor(learning_rate) if isinstance(learning_rate, np.ndarray) else learning_rate
    groups = param_groups(net, weight_decay, norm_weight_decay, bias_weight_decay)
    if name == "Adam":
        return nn.Adam(groups, learning_rate=lr, loss_scale=loss_scale)
    if name == "AdamW":
        decays, undecayed = _without_decay(groups)
        return AdamW(nn.Adam(undecayed, learning_rate=lr, eps=1e-8, loss_scale=loss_scale), weight_decays=decays)
    if name == "SGD":
        return nn.SGD(groups, learning_rate=lr, momentum=momentum, nesterov=use_nesterov, loss_scale=loss_scale)
    if name == "LARS":
        return create_lars(net, groups, learning_rate=lr, momentum=momentum, use_nesterov=use_nesterov,
                           loss_scale=loss_scale, coefficient=lars_coefficient, epsilon=lars_epsilon)
    return nn.Momentum(groups, learning_rate=lr, momentum=momentum, loss_scale=loss_scale)


def create_lars(net: nn.Cell, groups: List[Dict], *, learning_rate, momentum: float, use_nesterov: bool,
                loss_scale: float, coefficient: float, epsilon: float) -> LARS:
    """LARS over `groups`: their decays move into LARS, the trust ratio covers conv/dense weights."""
    if loss_scale != 1.0:
        raise UserInputError("LARS cannot undo a loss scale itself; build it with loss_scale 1.0")
    decays, undecayed = _without_decay(groups)
    inner = nn.SGD(undecayed, learning_rate=learning_rate, momentum=momentum, nesterov=use_nesterov)
    weights = set(decayed_parameter_names(net))
    return LARS(inner, weight_decays=decays, trusted=[p.name in weights for p in inner.parameters],
                coefficient=coefficient, epsilon=epsilon)


def _without_decay(groups: List[Dict]) -> Tuple[List[float], List[Dict]]:
    """For optimizers that apply the decay themselves: each parameter's decay in the parameter
    order, and the same groups with decay 0 for the inner optimizer."""
    decay_of = {p.name: group["weight_decay"] for group in groups[:-1] for p in group["params"]}
    order = groups[-1]["order_params"]
    undecayed = [{"params": group["params"], "weight_decay": 0.0} for group in groups[:-1]] + groups[-1:]
    return [float(decay_of[p.name]) for p in order], undecayed
