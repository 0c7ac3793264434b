"""src/training/optimizer.py: weight decay on conv/dense weights only; Momentum and Adam."""
import re

import numpy as np
import pytest
from mindspore import Tensor, nn

from conftest import needs_torch
from src.errors import UserInputError
from src.resnet import create_model
from src.training.optimizer import create_optimizer, decayed_parameter_names, param_groups

CONV_OR_FC_WEIGHT = re.compile(r"(^conv1\.weight$|\.conv\d\.weight$|\.downsample\.0\.weight$|^fc\.weight$)")


@pytest.fixture(scope="module")
def net():
    return create_model("resnet18", num_classes=10)


def test_decayed_group_is_exactly_the_conv_and_fc_weights(net):
    groups = param_groups(net, 1e-4)
    assert len(groups) == 3
    decayed, plain, order = groups
    assert decayed["weight_decay"] == 1e-4 and plain["weight_decay"] == 0.0
    names = [p.name for p in decayed["params"]]
    # resnet18: conv1 + 8 blocks x 2 convs + 3 downsample convs = 20 conv weights, plus fc.weight
    assert len(names) == 21
    assert sum(1 for n in names if n != "fc.weight") == 20
    assert "fc.weight" in names
    assert all(CONV_OR_FC_WEIGHT.search(n) for n in names), names
    assert not [n for n in names if n.endswith((".gamma", ".beta", ".bias"))]
    expected = {p.name for p in net.trainable_params() if CONV_OR_FC_WEIGHT.search(p.name)}
    assert set(names) == expected
    assert set(decayed_parameter_names(net)) == expected


def test_every_trainable_parameter_is_in_one_group_once(net):
    decayed, plain, order = param_groups(net, 1e-4)
    trainable = [p.name for p in net.trainable_params()]
    grouped = [p.name for p in decayed["params"]] + [p.name for p in plain["params"]]
    assert sorted(grouped) == sorted(trainable)
    assert len(grouped) == len(set(grouped)) == 62
    assert [p.name for p in order["order_params"]] == trainable
    plain_names = [p.name for p in plain["params"]]
    assert "fc.bias" in plain_names and "bn1.gamma" in plain_names and "bn1.beta" in plain_names
    assert all(n.endswith((".gamma", ".beta", ".bias")) for n in plain_names), plain_names
    assert not [n for n in plain_names if "moving" in n]


@pytest.mark.parametrize("name,cls", [("Momentum", nn.Momentum), ("Adam", nn.Adam)])
def test_create_optimizer_builds_the_named_optimizer(net, name, cls):
    lr = np.linspace(0.1, 0.01, 5).astype(np.float32)
    opt = create_optimizer(net, name=name, learning_rate=lr, weight_decay=1e-4)
    assert isinstance(opt, cls)
    assert [p.name for p in opt.parameters] == [p.name for p in net.trainable_params()]
    opt = create_optimizer(net, name=name, learning_rate=0.1, weight_decay=1e-4, loss_scale=8.0)
    assert isinstance(opt, cls)


def test_unknown_optimizer_raises(net):
    with pytest.raises(UserInputError, match="SGDW"):
        create_optimizer(net, name="SGDW", learning_rate=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["Momentum", "Adam"])
def test_one_step_with_zero_gradients_only_decays_conv_and_fc_weights(name):
    net = create_model("resnet18", num_classes=10)
    lr, wd = 0.1, 0.01
    opt = create_optimizer(net, name=name, learning_rate=lr, weight_decay=wd, momentum=0.9)
    params = list(opt.parameters)
    # perturb the BN/bias parameters so that decay would be visible on them too
    rng = np.random.default_rng(0)
    for p in params:
        if p.name.endswith((".gamma", ".beta", ".bias")):
            p.set_data(Tensor(rng.uniform(0.5, 1.5, p.shape).astype(np.float32)))
    before = {p.name: p.asnumpy().copy() for p in params}
    opt(tuple(Tensor(np.zeros(p.shape, np.float32)) for p in params))
    decayed = set(decayed_parameter_names(net))
    for p in params:
        old, new = before[p.name], p.asnumpy()
        if p.name in decayed:
            if name == "Momentum":
                # gradient + wd * w with a zero gradient: w <- w - lr * wd * w
                np.testing.assert_allclose(new, old * (1 - lr * wd), rtol=1e-5, atol=1e-8, err_msg=p.name)
            else:
                # Adam's first step on the gradient wd * w alone: w <- w - lr * sign(w)
                # (up to eps = 1e-8 added to sqrt((1 - beta2) * (wd * w) ** 2): under 0.4% for |w| > 0.01)
                big = np.abs(old) > 1e-2
                assert big.mean() > 0.3, p.name
                np.testing.assert_allclose(new[big] - old[big], -lr * np.sign(old[big]),
                                           rtol=0, atol=lr * 0.01, err_msg=p.name)
        else:
            np.testing.assert_array_equal(new, old, err_msg=p.name)


class TinyNet(nn.Cell):
    """One conv (no bias), one BatchNorm and one dense layer (with bias): every parameter kind."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, has_bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Dense(4, 2)

    def construct(self, x):
        return self.fc(self.bn(self.conv(x)).mean(axis=(2, 3)))


KIND = {"conv.weight": "weight", "fc.weight": "weight", "bn.gamma": "norm", "bn.beta": "norm", "fc.bias": "bias"}


def test_norm_and_bias_decay_follow_the_owning_cell():
    groups = param_groups(TinyNet(), 1e-4, norm_weight_decay=1e-5, bias_weight_decay=1e-3)
    assert [(sorted(p.name for p in g["params"]), g["weight_decay"]) for g in groups[:-1]] == [
        (["conv.weight", "fc.weight"], 1e-4), (["bn.beta", "bn.gamma"], 1e-5), (["fc.bias"], 1e-3)]
    # equal decays share one group: the defaults give today's two groups
    assert len(param_groups(TinyNet(), 1e-4, norm_weight_decay=1e-5, bias_weight_decay=1e-5)) == 3


def numpy_steps(name: str, weights: dict, grads: list, *, lr: float, momentum: float, decay: dict,
                coefficient: float = 1e-3, epsilon: float = 1e-5) -> dict:
    """Reference updates: torch's SGD with Nesterov momentum, or LARS (decay, then the trust ratio
    on conv/dense weights) followed by Nesterov momentum."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    velocity = {k: np.zeros_like(v) for k, v in w.items()}
    for grad in grads:
        for k in w:
            g = grad[k] + decay[k] * w[k]
            if name == "LARS" and KIND[k] == "weight":
                w_norm, g_norm = np.linalg.norm(w[k]), np.linalg.norm(grad[k])
                g = g * coefficient * w_norm / (g_norm + decay[k] * w_norm + epsilon)
            velocity[k] = momentum * velocity[k] + g
            w[k] = w[k] - lr * (g + momentum * velocity[k])
    return w


@pytest.mark.parametrize("name", ["SGD", "LARS"])
def test_nesterov_sgd_and_lars_match_numpy_over_two_steps(name):
    net = TinyNet()
    wd = {"weight": 1e-2, "norm": 1e-3, "bias": 1e-1}
    opt = create_optimizer(net, name=name, learning_rate=0.1, weight_decay=wd["weight"], momentum=0.9,
                           norm_weight_decay=wd["norm"], bias_weight_decay=wd["bias"], use_nesterov=True,
                           lars_coefficient=0.01)
    params = list(opt.parameters)
    rng = np.random.default_rng(0)
    start = {p.name: p.asnumpy().copy() for p in params}
    grads = [{p.name: rng.standard_normal(p.shape).astype(np.float32) for p in params} for _ in range(2)]
    for grad in grads:
        opt(tuple(Tensor(grad[p.name]) for p in params))
    expected = numpy_steps(name, start, grads, lr=0.1, momentum=0.9,
                           decay={k: wd[KIND[k]] for k in start}, coefficient=0.01)
    for p in params:
        np.testing.assert_allclose(p.asnumpy(), expected[p.name], rtol=1e-5, atol=1e-6, err_msg=p.name)


def test_adamw_decays_decoupled_from_the_gradient():
    # With a zero gradient Adam's step is 0, so only the decoupled decay moves the weights: w(1 - lr wd).
    net = TinyNet()
    opt = create_optimizer(net, name="AdamW", learning_rate=0.1, weight_decay=0.5, norm_weight_decay=0.25)
    params = list(opt.parameters)
    before = {p.name: p.asnumpy().copy() for p in params}
    opt(tuple(Tensor(np.zeros(p.shape, np.float32)) for p in params))
    factor = {"weight": 1 - 0.1 * 0.5, "norm": 1 - 0.1 * 0.25, "bias": 1.0}
    for p in params:
        np.testing.assert_allclose(p.asnumpy(), before[p.name] * factor[KIND[p.name]], rtol=1e-6, err_msg=p.name)


@needs_torch
@pytest.mark.slow
def test_adamw_matches_torch_adamw_over_two_steps():
    import torch
    net = TinyNet()
    wd = {"weight": 0.05, "norm": 0.0, "bias": 0.01}
    opt = create_optimizer(net, name="AdamW", learning_rate=np.array([0.01, 0.02], np.float32),
                           weight_decay=wd["weight"], norm_weight_decay=wd["norm"], bias_weight_decay=wd["bias"])
    params = list(opt.parameters)
    reference = {p.name: torch.tensor(p.asnumpy().astype(np.float64), requires_grad=True) for p in params}
    torch_opt = torch.optim.AdamW([{"params": [reference[p.name]], "weight_decay": wd[KIND[p.name]]} for p in params],
                                  lr=0.01, eps=1e-8)
    rng = np.random.default_rng(1)
    for lr, scale in ((0.01, 1e-7), (0.02, 1.0)):  # tiny gradients first: where eps's placement tells
        grads = {p.name: (rng.standard_normal(p.shape) * scale).astype(np.float32) for p in params}
        opt(tuple(Tensor(grads[p.name]) for p in params))
        for group in torch_opt.param_groups:
            group["lr"] = lr
        for name, tensor in reference.items():
            tensor.grad = torch.tensor(grads[name].astype(np.float64))
        torch_opt.step()
    for p in params:
        # float32 against float64: Adam's normalized step (about lr per element) carries ~1e-4 relative noise;
        # the decay (lr x wd x w ~ 1e-4) and bias correction (3x the first step) are far above it
        np.testing.assert_allclose(p.asnumpy(), reference[p.name].detach().numpy(), rtol=0, atol=1e-5,
                                   err_msg=p.name)


def test_thor_is_built_by_train_py_not_here(net):
    """optimizer Thor is MindSpore's nn.thor with ModelThor (src/training/thor.py), not one of the
    training step's optimizers."""
    with pytest.raises(UserInputError, match="src/training/thor.py"):
        create_optimizer(net, name="Thor", learning_rate=0.1)
