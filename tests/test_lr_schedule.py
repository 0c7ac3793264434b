"""src/training/lr_schedule.py: per-step learning rates, checked against numbers computed by hand.

Common set-up: lr_init 0.02, lr_max 0.1, lr_end 0.02, 6 steps of which 2 warm up.
Warmup: step 0 -> 0.02, step 1 -> 0.02 + 0.08 * 1/2 = 0.06.
Decay over the 4 remaining steps, progress p = 0, 0.25, 0.5, 0.75.
"""
import numpy as np
import pytest

from src.errors import UserInputError
from src.training.lr_schedule import (
    LR_DECAY_MODES,
    create_lr_schedule,
    create_thor_damping_schedule,
    create_thor_lr_schedule,
    warmup_cut_short,
)

COMMON = dict(lr_init=0.02, lr_max=0.1, lr_end=0.02, total_steps=6, warmup_steps=2)
WARMUP = [0.02, 0.06]
EXPECTED = {
    # lr_max throughout
    "constant": WARMUP + [0.1, 0.1, 0.1, 0.1],
    # 0.02 + 0.08 * (1 - p)
    "linear": WARMUP + [0.1, 0.08, 0.06, 0.04],
    # 0.02 + 0.08 * 0.5 * (1 + cos(pi p)); cos(pi/4) = 0.70710678
    "cosine": WARMUP + [0.1, 0.0882842712, 0.06, 0.0317157288],
    # 0.02 + 0.08 * (1 - p) ** 2 (power 2)
    "poly": WARMUP + [0.1, 0.065, 0.04, 0.025],
    # lr_max * 0.1 ** (milestones <= step), milestones [3, 5]
    "steps": WARMUP + [0.1, 0.01, 0.01, 0.001],
    # the model zoo's 'step': lr_max below p 0.2, x0.1 below 0.5, x0.01 below 0.7, x0.001 below 0.9
    "step": WARMUP + [0.1, 0.01, 0.001, 0.0001],
}
EXTRA = {"steps": dict(milestones=[3, 5], gamma=0.1), "poly": dict(power=2.0)}


def schedule(mode, **overrides):
    kwargs = dict(COMMON, **EXTRA.get(mode, {}))
    kwargs.update(overrides)
    return create_lr_schedule(mode, **kwargs)


def test_every_mode_is_covered():
    assert set(EXPECTED) == set(LR_DECAY_MODES)


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_values_by_hand(mode):
    lrs = schedule(mode)
    assert lrs.dtype == np.float32
    assert lrs.shape == (6,)
    np.testing.assert_allclose(lrs, np.array(EXPECTED[mode], np.float32), rtol=1e-6, atol=1e-9)


def test_poly_power_1_is_linear_and_power_3_by_hand():
    np.testing.assert_allclose(schedule("poly", power=1.0), schedule("linear"), rtol=1e-6)
    # 0.02 + 0.08 * (1 - p) ** 3: 0.1, 0.05375, 0.03, 0.02125
    np.testing.assert_allclose(schedule("poly", power=3.0),
                               np.array(WARMUP + [0.1, 0.05375, 0.03, 0.02125], np.float32), rtol=1e-6)


def test_without_warmup_decay_starts_at_lr_max():
    # linear over 4 steps from 0.1 to 0.0: 0.1, 0.075, 0.05, 0.025
    lrs = create_lr_schedule("linear", lr_init=0.5, lr_max=0.1, lr_end=0.0, total_steps=4)
    np.testing.assert_allclose(lrs, np.array([0.1, 0.075, 0.05, 0.025], np.float32), rtol=1e-6)


def test_all_warmup():
    # 0.02 + 0.08 * step / 4
    lrs = create_lr_schedule("cosine", lr_init=0.02, lr_max=0.1, lr_end=0.0, total_steps=4, warmup_steps=4)
    np.testing.assert_allclose(lrs, np.array([0.02, 0.04, 0.06, 0.08], np.float32), rtol=1e-6)


def test_zoo_step_ends_at_lr_end():
    # 10 steps, no warmup, p = k/10: 0.1 x2, 0.01 x3, 0.001 x2, 0.0001 x2, then lr_end 0.00005
    lrs = create_lr_schedule("step", lr_init=0.0, lr_max=0.1, lr_end=0.00005, total_steps=10)
    expected = [0.1] * 2 + [0.01] * 3 + [0.001] * 2 + [0.0001] * 2 + [0.00005]
    np.testing.assert_allclose(lrs, np.array(expected, np.float32), rtol=1e-6)


def test_steps_counts_milestones_inside_warmup_after_it():
    # a milestone during warmup still counts afterwards: 0.1 * 0.5 ** 1 at steps 2, 3
    lrs = schedule("steps", milestones=[1], gamma=0.5, total_steps=4)
    np.testing.assert_allclose(lrs, np.array([0.02, 0.06, 0.05, 0.05], np.float32), rtol=1e-6)


@pytest.mark.parametrize("mode", sorted(EXPECTED))
@pytest.mark.parametrize("start", [0, 1, 2, 3, 5, 6])
def test_start_step_is_the_exact_tail(mode, start):
    full = schedule(mode)
    tail = schedule(mode, start_step=start)
    assert tail.dtype == np.float32
    assert len(tail) == 6 - start
    np.testing.assert_array_equal(tail, full[start:])


def test_start_step_on_a_long_schedule():
    kwargs = dict(lr_init=0.001, lr_max=0.4, lr_end=1e-5, total_steps=1000, warmup_steps=57, power=2.0)
    full = create_lr_schedule("poly", **kwargs)
    for start in (0, 56, 57, 58, 499, 999, 1000):
        tail = create_lr_schedule("poly", start_step=start, **kwargs)
        assert len(tail) == 1000 - start
        np.testing.assert_array_equal(tail, full[start:])


def test_a_warmup_longer_than_the_run_is_cut_short_as_the_zoo_does():
    """warmup_epochs 5 of 6 steps each with --epoch_size 2: 30 warmup steps in a run of 12; every
    step is on the warmup's line from lr_init towards lr_max (0.02 + 0.08 * s / 30)."""
    lrs = create_lr_schedule("cosine", lr_init=0.02, lr_max=0.1, lr_end=0.0, total_steps=12, warmup_steps=30)
    np.testing.assert_allclose(lrs, [0.02 + 0.08 * s / 30 for s in range(12)], rtol=1e-6)
    assert warmup_cut_short(30, 12).startswith("warmup of 30 steps is longer than the run's 12")
    assert warmup_cut_short(12, 12) == ""
    np.testing.assert_array_equal(create_lr_schedule("cosine", lr_init=0.02, lr_max=0.1, lr_end=0.0,
                                                     total_steps=12, warmup_steps=30, start_step=5), lrs[5:])


@pytest.mark.parametrize("kwargs,word", [
    (dict(mode="exponential"), "exponential"),
    (dict(mode="cosine", warmup_steps=-1), "warmup"),
    (dict(mode="cosine", start_step=7), "start step"),
    (dict(mode="cosine", start_step=-1), "start step"),
])
def test_bad_arguments_raise(kwargs, word):
    kwargs = dict(COMMON, **kwargs)
    with pytest.raises(UserInputError, match=word):
        create_lr_schedule(kwargs.pop("mode"), **kwargs)


# THOR (the model zoo's Thor configs): lr_init 0.1, lr_decay 2, lr_end_epoch 5, 2 steps per epoch,
# 8 steps, halvings from epoch 3. Step s ends epoch e = (s + 1) / 2 = 0.5, 1, ..., 4;
# 0.1 * (1 - e / 5) ** 2 = 0.081, 0.064, 0.049, 0.036, 0.025, 0.016, 0.009, 0.004,
# halved at e >= 3 (0.008, 0.0045, 0.002) and again at e >= 4 (0.001).
THOR_LR = dict(lr_init=0.1, lr_decay=2.0, lr_end_epoch=5, steps_per_epoch=2, total_steps=8, halving_epoch=3)
THOR_EXPECTED = [0.081, 0.064, 0.049, 0.036, 0.025, 0.008, 0.0045, 0.001]


def test_thor_lr_by_hand():
    lrs = create_thor_lr_schedule(**THOR_LR)
    assert lrs.dtype == np.float32
    np.testing.assert_allclose(lrs, THOR_EXPECTED, rtol=1e-6)


def test_thor_lr_resumes_where_it_was():
    np.testing.assert_allclose(create_thor_lr_schedule(**THOR_LR, start_step=5), THOR_EXPECTED[5:], rtol=1e-6)


def test_thor_lr_refuses_a_run_longer_than_lr_end_epoch():
    # 6 epochs past the curve's zero at epoch 5: (1 - 6/5) ** 4.08 would be NaN
    with pytest.raises(UserInputError, match="lr_end_epoch 5"):
        create_thor_lr_schedule(**dict(THOR_LR, total_steps=12))


def test_thor_damping_by_hand():
    """0.04 * 0.25 ** (e / 10), 5 steps per epoch: e = 1 at step 4 -> 0.04 * 2 ** -0.2 = 0.0348220225;
    e = 5 at step 24 -> 0.04 * 0.5 = 0.02; e = 10 at step 49 -> 0.01."""
    damping = create_thor_damping_schedule(damping_init=0.04, damping_decay=0.25, steps_per_epoch=5, total_steps=50)
    assert damping.shape == (50,) and damping.dtype == np.float32
    np.testing.assert_allclose(damping[[4, 24, 49]], [0.0348220225, 0.02, 0.01], rtol=1e-6)
    np.testing.assert_allclose(create_thor_damping_schedule(damping_init=0.04, damping_decay=0.25, steps_per_epoch=5,
                                                            total_steps=50, start_step=24), damping[24:])


@pytest.mark.parametrize("init, decay", [(0.0, 0.5), (0.03, 0.0), (0.03, 1.5)])
def test_thor_damping_refuses_bad_values(init, decay):
    with pytest.raises(UserInputError, match="damping"):
        create_thor_damping_schedule(damping_init=init, damping_decay=decay, steps_per_epoch=5, total_steps=50)
