"""src/training/train_step.py: the one training step checked against independent computations: the stock
MindSpore cell, one big batch, a NumPy clip, a NumPy EMA recurrence and a run without the
overflowing batch. These run in PyNative mode, where they are cheapest; train.py compiles the same
cell in GRAPH mode in tests/test_resume.py and tests/test_distributed.py."""
import time

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops
from mindspore.train.callback import RunContext
from mindspore.train.callback._callback import InternalCallbackParam

from conftest import PYTHON, REPO, run
from cpu_layers_marks import needs_library
from src.cpu_layers import (
    all_finite_op,
    momentum_step_op,
    unavailable_reason,
    unscale_all_finite_op,
    use_onednn_layers,
)
from src.resnet import create_model
from src.training.callbacks import TrainMonitor
from src.training.checkpoint import EMA_PREFIX
from src.training.faults import DivergedError, DivergenceGuard
from src.training.loss import create_loss
from src.training.optimizer import create_optimizer
from src.training.run_record import RunRecord
from src.training.train_step import EmaSchedule, NetWithLoss, TrainStep, ema_schedule

CONFIG = str(REPO / "config" / "sample_resnet18.yaml")
NET = "resnet10"  # the smallest of the family: what a step does does not depend on depth
IMAGE = 8  # small images keep the network cheap; the step does not care about the size


@pytest.fixture(scope="module")
def initial():
    """One set of initial weights that every network in this module starts from."""
    ms.set_seed(0)
    return {p.name: p.asnumpy().copy() for p in create_model(NET, num_classes=10).get_parameters()}


def network(initial: dict, freeze_bn: bool = True) -> nn.Cell:
    net = create_model(NET, num_classes=10, freeze_bn=freeze_bn)
    for param in net.get_parameters():
        param.set_data(Tensor(initial[param.name]))
    return net


def batches(count: int, size: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((size, 3, IMAGE, IMAGE)).astype(np.float32),
             rng.integers(0, 10, size).astype(np.int32)) for _ in range(count)]


def train_step(net: nn.Cell, *, optimizer: str = "Momentum", lr: float = 0.05, momentum: float = 0.9, **options):
    opt = create_optimizer(net, name=optimizer, learning_rate=lr, weight_decay=1e-4, momentum=momentum)
    return TrainStep(NetWithLoss(net, create_loss(num_classes=10)), opt, net=net, **options)


def values(params) -> dict:
    return {p.name: p.asnumpy().copy() for p in params}


def worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[name] - b[name]).max()) for name in a)


@pytest.mark.slow
@pytest.mark.parametrize("loss_scale", [1.0, 1024.0])
def test_plain_step_trains_like_mindspores_own_cell(initial, loss_scale):
    # BatchNorm in training mode: its moving statistics must match too.
    ours_net, stock_net = network(initial, freeze_bn=False), network(initial, freeze_bn=False)
    ours = train_step(ours_net, loss_scale=loss_scale)
    stock_opt = create_optimizer(stock_net, name="Momentum", learning_rate=0.05, weight_decay=1e-4,
                                 momentum=0.9, loss_scale=loss_scale)  # today: the optimizer unscales
    stock = nn.TrainOneStepCell(nn.WithLossCell(stock_net, create_loss(num_classes=10)), stock_opt,
                                sens=loss_scale)
    for images, labels in batches(2, 8):
        loss, overflow, scale = ours(Tensor(images), Tensor(labels))
        expected = stock(Tensor(images), Tensor(labels))
        assert abs(float(loss.asnumpy()) - float(expected.asnumpy())) < 1e-6
        assert not bool(overflow.asnumpy()) and float(scale.asnumpy()) == loss_scale
    assert worst(values(ours_net.get_parameters()), values(stock_net.get_parameters())) < 1e-6


@pytest.mark.slow
def test_two_micro_batches_of_8_equal_one_batch_of_16(initial):
    accumulated_net, whole_net = network(initial), network(initial)  # frozen BatchNorm: same statistics
    accumulated = train_step(accumulated_net, accumulation_steps=2, micro_batch=8)
    whole = train_step(whole_net)
    for images, labels in batches(3, 16):
        loss_a = accumulated(Tensor(images), Tensor(labels))[0]
        loss_w = whole(Tensor(images), Tensor(labels))[0]
        assert abs(float(loss_a.asnumpy()) - float(loss_w.asnumpy())) < 1e-5  # mean of the micro-batch losses
    difference = worst(values(accumulated_net.trainable_params()), values(whole_net.trainable_params()))
    print(f"accumulation 2 x 8 vs batch 16 after 3 steps: max abs weight difference {difference:.2e}")
    assert difference < 1e-5


@pytest.mark.slow
def test_clipping_equals_a_numpy_global_norm_clip(initial):
    images, labels = (Tensor(x) for x in batches(1, 8)[0])
    reference = network(initial)
    weights = ms.ParameterTuple(reference.trainable_params())
    grads = ops.GradOperation(get_by_list=True)(NetWithLoss(reference, create_loss(num_classes=10)), weights)(
        images, labels)
    grads = [g.asnumpy().astype(np.float64) for g in grads]
    norm = np.sqrt(sum(float((g ** 2).sum()) for g in grads))
    clip, lr = norm / 4, 0.1
    clipped = [g * min(1.0, clip / (norm + 1e-6)) for g in grads]

    net = network(initial)
    # plain SGD without momentum or decay: the update is exactly -lr * the clipped gradient
    opt = create_optimizer(net, name="SGD", learning_rate=lr, weight_decay=0.0, momentum=0.0)
    step = TrainStep(NetWithLoss(net, create_loss(num_classes=10)), opt, net=net, clip_grad_norm=clip)
    outputs = step(images, labels)
    expected = {p.name: initial[p.name] - lr * g for p, g in zip(net.trainable_params(), clipped)}
    difference = worst(values(net.trainable_params()), expected)
    print(f"clip to {clip:.4f} (norm {norm:.4f}) vs NumPy: max abs weight difference {difference:.2e}")
    assert difference < 1e-6
    assert len(outputs) == 4 and abs(float(outputs[3].asnumpy()) - norm) < 1e-5 * norm  # the norm before clipping


def numpy_ema(raw_after_step: list, start: dict, schedule: EmaSchedule) -> dict:
    """torchvision's EMA in NumPy: update every `every` steps within the epoch; copy while the
    step index is <= copy_until (warmup reset, then the first update after it)."""
    average = {name: value.astype(np.float64) for name, value in start.items()}
    for step, raw in enumerate(raw_after_step):
        if (step % schedule.steps_per_epoch) % schedule.every:
            continue
        alpha = 1.0 if step <= schedule.copy_until else schedule.alpha
        average = {name: average[name] * (1 - alpha) + raw[name] * alpha for name in average}
    return average


@pytest.mark.slow
def test_ema_equals_a_numpy_recurrence_of_the_raw_weights(initial):
    # 3 steps per epoch, 1 warmup epoch, an update every 2 steps: steps 0, 2, 3 copy; 5, 6 average.
    schedule = EmaSchedule(alpha=0.25, every=2, steps_per_epoch=3, copy_until=3)
    net = network(initial, freeze_bn=False)  # BatchNorm statistics move, and are averaged too
    step = train_step(net, ema=schedule)
    raw = []
    for images, labels in batches(7, 8, seed=1):
        step(Tensor(images), Tensor(labels))
        raw.append(values(net.get_parameters()))
    expected = numpy_ema(raw, initial, schedule)
    got = {p.name[len(EMA_PREFIX):]: p.asnumpy() for p in step.ema_params}
    difference = worst(got, expected)
    print(f"EMA after 7 steps vs NumPy recurrence: max abs difference {difference:.2e}")
    assert difference < 1e-6
    assert int(step.train_steps.asnumpy()) == 7
    assert worst(got, raw[-1]) > 1e-3  # the last two updates averaged, so the EMA lags the raw weights


@pytest.mark.slow
@needs_library
@pytest.mark.parametrize("loss_scale", [1.0, 1024.0])
def test_one_momentum_op_moves_every_weight_as_mindspores_optimizer_bit_for_bit(initial, loss_scale):
    """Our layers take nn.Momentum's step (unscale, check, weight decay, ApplyMomentum) in one
    kernel: the weights, moments, step count and BatchNorm statistics equal those of MindSpore's
    optimizer cell bit for bit, step after step."""
    def trained(one_op: bool):
        net = network(initial, freeze_bn=False)
        use_onednn_layers(net)
        checks = {"all_finite": all_finite_op(), "unscale_all_finite": unscale_all_finite_op()}
        if one_op:
            checks["momentum_step"] = momentum_step_op(len(net.trainable_params()))
        step = train_step(net, loss_scale=loss_scale, **checks)
        losses = [float(step(Tensor(images), Tensor(labels))[0].asnumpy()) for images, labels in batches(3, 8)]
        return losses, values(step.get_parameters())

    losses, expected = trained(one_op=False)
    fused_losses, got = trained(one_op=True)
    assert fused_losses == losses
    assert got.keys() == expected.keys() and any(name.startswith("moments.") for name in got)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_ema_decay_adjustment_is_torchvisions():
    # torchvision's recipe: 8 GPUs x 128 images, every 32 steps, 600 epochs, decay 0.99998
    schedule = ema_schedule(decay=0.99998, every=32, world_size=8, batch_size=64, accumulation_steps=2,
                            epochs=600, warmup_epochs=5, steps_per_epoch=1251)
    assert schedule.alpha == pytest.approx(2e-5 * 8 * 128 * 32 / 600)
    assert schedule.copy_until == 5 * 1251
    assert ema_schedule(decay=0.5, every=32, world_size=8, batch_size=128, accumulation_steps=1, epochs=1,
                        warmup_epochs=0, steps_per_epoch=10).alpha == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("layers, freeze_bn", [("mindspore", True), ("onednn", True), ("onednn", False),
                                               ("onednn-momentum-step", False)],
                         ids=["mindspore", "onednn", "onednn-batch-statistics", "onednn-momentum-step"])
def test_overflow_skips_the_update_and_leaves_nothing_behind(initial, layers, freeze_bn):
    """Dynamic loss scale: a batch with an inf gives non-finite gradients; the step must leave the
    weights, the optimizer state and the EMA as they were, halve the scale, and leave no partial
    accumulation: the run then continues exactly like a run that never saw that batch. With our
    CPU layers (blocked) the unscaling and the check are one op over every gradient; with batch statistics
    their kernel moves the BatchNorm statistics in place, and the skipped step puts them back."""
    if layers.startswith("onednn") and unavailable_reason():
        pytest.skip(unavailable_reason())
    schedule = EmaSchedule(alpha=0.5, every=1, steps_per_epoch=100, copy_until=-1)
    clean = batches(2, 8, seed=2)
    bad_images = clean[1][0].copy()
    bad_images[5, 0, 3, 3] = np.inf  # in the second micro-batch

    def run(batch_list):
        net = network(initial, freeze_bn=freeze_bn)
        net.set_train(True)
        checks = {}
        if layers.startswith("onednn"):
            use_onednn_layers(net)
            checks = {"all_finite": all_finite_op(), "unscale_all_finite": unscale_all_finite_op()}
        if layers == "onednn-momentum-step":
            checks["momentum_step"] = momentum_step_op(len(net.trainable_params()))
        update = nn.DynamicLossScaleUpdateCell(loss_scale_value=2.0 ** 10, scale_factor=2, scale_window=1000)
        step = train_step(net, accumulation_steps=2, micro_batch=4, ema=schedule, loss_scale=2.0 ** 10,
                          scale_update=update, **checks)
        outputs = []
        for images, labels in batch_list:
            outputs.append(step(Tensor(images), Tensor(labels)))
            yield step, outputs[-1]

    with_overflow = run([clean[0], (bad_images, clean[1][1]), clean[1]])
    step, first = next(with_overflow)
    before = values(step.get_parameters())
    step, (_, overflow, scale) = next(with_overflow)
    after = values(step.get_parameters())
    assert bool(overflow.asnumpy()) and float(scale.asnumpy()) == 1024.0
    assert float(step.scale_sense.asnumpy()) == 512.0
    unchanged = [name for name in before if name not in ("scale_sense", "train_steps", "current_iterator_step",
                                                         "last_overflow_iterator_step")]
    assert any(name.startswith(EMA_PREFIX) for name in unchanged) and any(n.startswith("moments.") for n in unchanged)
    for name in unchanged:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    step, (_, overflow, _) = next(with_overflow)
    assert not bool(overflow.asnumpy())

    never_saw_it = run([clean[0], clean[1]])
    reference, _ = list(never_saw_it)[-1]
    # powers of two scale exactly, so the halved scale changes nothing but the skipped step
    assert worst(values(step.ema_params), values(reference.ema_params)) < 1e-7
    assert worst(values(step.optimizer.parameters), values(reference.optimizer.parameters)) < 1e-7


BAD_VALUES = [
    ("grad_accumulation_steps", "0"), ("model_ema_steps", "0"), ("model_ema_decay", "1.0"),
    ("model_ema_decay", "-0.1"), ("clip_grad_norm", "-1"), ("norm_weight_decay", "-1e-4"),
    ("bias_weight_decay", "-1e-4"), ("lars_coefficient", "0"), ("lars_epsilon", "-1"),
    ("optimizer", "Lamb"), ("use_nesterov", "maybe"), ("model_ema", "yes please"),
]


@pytest.mark.parametrize("key,value", BAD_VALUES)
def test_bad_values_of_the_step_keys_are_errors_naming_the_key(key, value):
    from src.config import load_config
    from src.errors import UserInputError
    from src.training.factory import check_step_keys
    extra = {"model_ema_decay": ["--model_ema", "True"], "lars_coefficient": ["--optimizer", "LARS"]}.get(key, [])
    with pytest.raises(UserInputError, match=key):
        check_step_keys(load_config(["--config_path", CONFIG, f"--{key}", value] + extra))


def test_nesterov_needs_a_momentum_optimizer_and_momentum():
    from src.config import load_config
    from src.errors import UserInputError
    from src.training.factory import check_step_keys
    for extra in (["--optimizer", "AdamW"], ["--optimizer", "SGD", "--momentum", "0"]):
        with pytest.raises(UserInputError, match="use_nesterov"):
            check_step_keys(load_config(["--config_path", CONFIG, "--use_nesterov", "True"] + extra))


@pytest.mark.slow
def test_train_py_reports_a_bad_step_key_in_one_line_and_writes_nothing(tmp_path, cifar_dir):
    result = run([PYTHON, "train.py", "--config_path", CONFIG, "--data_path", str(cifar_dir), "--output_dir",
                  str(tmp_path / "out"), "--model_ema", "True", "--model_ema_decay", "1.5"])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "model_ema_decay" in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_logged_lr_is_the_one_the_optimizer_applied_after_a_skipped_step(initial):
    """A step skipped for non-finite gradients does not advance the optimizer's schedule: the lr
    logged for the next step (and named by the divergence guard) is the one applied then, by the
    optimizer's own count of updates, not by the callback's step count."""
    lrs = np.array([0.01, 0.02, 0.03, 0.04], np.float32)
    net = network(initial)
    step = train_step(net, lr=lrs, loss_scale=2.0 ** 10,
                      scale_update=nn.DynamicLossScaleUpdateCell(loss_scale_value=2.0 ** 10, scale_factor=2,
                                                                 scale_window=1000))
    (images, labels), = batches(1, 4, seed=5)
    bad = images.copy()
    bad[0, 0, 0, 0] = np.inf
    logged = []
    monitor = TrainMonitor(steps_per_epoch=10, total_steps=10, global_batch=4, lrs=lrs, log_interval=1,
                           log=logged.append)
    guard = DivergenceGuard(patience=1, steps_per_epoch=10, lrs=lrs, skips_overflow=False, hints="x")
    for number, batch in enumerate([images, bad, images], 1):
        outputs = step(Tensor(batch), Tensor(labels))
        context = RunContext(InternalCallbackParam(net_outputs=outputs, cur_step_num=number, cur_epoch_num=1,
                                                   train_network=step))
        if number == 2:  # skipped: no update; the guard names the skipped step's own lr, 0.02
            assert bool(outputs[1].asnumpy())
            with pytest.raises(DivergedError, match=r"global step 2, lr 0\.02\)"):
                guard.on_train_step_end(context)
        monitor.on_train_step_end(context)
    assert int(step.optimizer.global_step.asnumpy()[0]) == 2  # updates applied at steps 1 and 3
    assert [line.split(" lr ")[1].split()[0] for line in logged] == ["0.010000", "0.010000", "0.020000"]


def test_an_epochs_first_logged_rate_leaves_out_the_evaluation_before_it(tmp_path):
    """The img/s of an epoch's first window counts that epoch's steps alone: the evaluation and
    checkpoints that ended the epoch before (here a 1.5 s pause) are not training time."""
    record = RunRecord(str(tmp_path))
    monitor = TrainMonitor(steps_per_epoch=2, total_steps=4, global_batch=4, lrs=[0.1] * 4, log_interval=1,
                           log=lambda line: None, record=record)
    loss = Tensor(np.float32(1.0))

    def context(step: int) -> RunContext:
        return RunContext(InternalCallbackParam(net_outputs=loss, cur_step_num=step, cur_epoch_num=(step + 1) // 2,
                                                train_network=None))

    monitor.on_train_begin(context(1))
    for step in (1, 2, 3):
        if step % 2:
            monitor.on_train_epoch_begin(context(step))
        monitor.on_train_step_end(context(step))
        if step == 2:
            monitor.on_train_epoch_end(context(step))
            time.sleep(1.5)  # the epoch-end evaluation
    first_of_epoch_2 = record.rows[-1]
    assert int(first_of_epoch_2["step"]) == 3
    assert float(first_of_epoch_2["img_per_s"]) > 8  # 4 images in under 0.5 s; counting the pause, under 2.7
