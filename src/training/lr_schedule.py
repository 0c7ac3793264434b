"""Learning-rate schedules as pure functions returning one float32 value per training step.

Every schedule warms up linearly from `lr_init` to `lr_max` over `warmup_steps`, then decays
from `lr_max` towards `lr_end` by its rule (the THOR schedules at the end follow the model zoo's
own rules instead). `start_step` cuts the front off, so a resumed run
continues exactly where the schedule was.
"""
import math
from typing import Callable, Dict, Sequence

import numpy as np

from src.errors import UserInputError


def _constant(lr_max: float, lr_end: float, progress: float) -> float:
    return lr_max


def _linear(lr_max: float, lr_end: float, progress: float) -> float:
    return lr_end + (lr_max - lr_end) * (1.0 - progress)


def _cosine(lr_max: float, lr_end: float, progress: float) -> float:
    return lr_end + (lr_max - lr_end) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _poly(lr_max: float, lr_end: float, progress: float, power: float = 2.0) -> float:
    return lr_end + (lr_max - lr_end) * (1.0 - progress) ** power


def _zoo_step(lr_max: float, lr_end: float, progress: float) -> float:
    """The model zoo's 'step' rule (resnet152 ImageNet): lr_max, then x0.1 at 20%, x0.01 at 50%,
    x0.001 at 70% of the steps, and the floor lr_end from 90% on (the zoo fixes that floor at 5e-5)."""
    for edge, factor in ((0.2, 1.0), (0.5, 0.1), (0.7, 0.01), (0.9, 0.001)):
        if progress < edge:
            return lr_max * factor
    return lr_end


DECAYS: Dict[str, Callable[..., float]] = {
    "constant": _constant, "linear": _linear, "cosine": _cosine, "poly": _poly, "step": _zoo_step,
}
LR_DECAY_MODES = tuple(DECAYS) + ("steps",)


def warmup_lr(step: int, *, lr_init: float, lr_max: float, warmup_steps: int) -> float:
    """Linear warmup: lr_init at step 0, reaching lr_max at step warmup_steps."""
    return lr_init + (lr_max - lr_init) * step / warmup_steps


def warmup_cut_short(warmup_steps: int, total_steps: int) -> str:
    """The line a run logs when its warmup is longer than the run (else '')."""
    if warmup_steps <= total_steps:
        return ""
    return (f"warmup of {warmup_steps} steps is longer than the run's {total_steps}: the lr stays on the warmup's "
            f"line (as the model zoo's schedules do) and never reaches lr_max")


def create_lr_schedule(mode: str, *, lr_init: float, lr_max: float, lr_end: float,
                       total_steps: int, warmup_steps: int = 0, start_step: int = 0,
                       milestones: Sequence[int] = (), gamma: float = 0.1,
                       power: float = 2.0) -> np.ndarray:
    """Per-step learning rates for steps [start_step, total_steps).

    mode: constant | linear | cosine | poly | steps | step (the model zoo's four fixed steps).
    A warmup longer than the run is cut short, as the model zoo's generators do: every step is
    then on the warmup's line (see `warmup_cut_short`).
    `milestones` (in steps) and `gamma` drive 'steps': lr_max * gamma ** (number of milestones <=
    step). `power` drives 'poly'.
    """
    if mode not in LR_DECAY_MODES:
        raise UserInputError(f"unknown lr_decay_mode '{mode}'; choose one of {', '.join(LR_DECAY_MODES)}")
    if warmup_steps < 0:
        raise UserInputError(f"warmup of {warmup_steps} steps: warmup_epochs must be >= 0")
    if not 0 <= start_step <= total_steps:
        raise UserInputError(f"start step {start_step} is outside the schedule of {total_steps} steps")
    decay_steps = total_steps - warmup_steps
    lrs = []
    for step in range(start_step, total_steps):
        if step < warmup_steps:
            lr = warmup_lr(step, lr_init=lr_init, lr_max=lr_max, warmup_steps=warmup_steps)
        elif mode == "steps":
            lr = lr_max * gamma ** sum(1 for m in milestones if step >= m)
        else:
            progress = (step - warmup_steps) / decay_steps
            lr = _poly(lr_max, lr_end, progress, power) if mode == "poly" \
                else DECAYS[mode](lr_max, lr_end, progress)
        lrs.append(lr)
    return np.asarray(lrs, dtype=np.float32)


def _step_epochs(steps_per_epoch: int, total_steps: int, start_step: int) -> np.ndarray:
    """The epoch each step ends in, as a fraction: (step + 1) / steps_per_epoch (THOR's clock)."""
    if steps_per_epoch <= 0:
        raise UserInputError(f"steps_per_epoch must be positive, got {steps_per_epoch}")
    if not 0 <= start_step <= total_steps:
        raise UserInputError(f"start step {start_step} is outside the schedule of {total_steps} steps")
    return (np.arange(start_step, total_steps, dtype=np.float64) + 1.0) / steps_per_epoch


def create_thor_lr_schedule(*, lr_init: float, lr_decay: float, lr_end_epoch: float, steps_per_epoch: int,
                            total_steps: int, halving_epoch: float = 39.0, start_step: int = 0) -> np.ndarray:
    """THOR's per-step learning rates for steps [start_step, total_steps), the model zoo's rule:
    lr_init * (1 - e / lr_end_epoch) ** lr_decay at epoch e = (step + 1) / steps_per_epoch, halved
    from epoch `halving_epoch` on and halved again one epoch later. The curve reaches 0 at
    lr_end_epoch, so a run must end by then (the zoo trains 45 of 53, 40 of 50 epochs)."""
    epochs = _step_epochs(steps_per_epoch, total_steps, start_step)
    if lr_end_epoch <= 0 or (len(epochs) and epochs[-1] > lr_end_epoch):
        raise UserInputError(f"lr_end_epoch {lr_end_epoch} must be positive and at least the run's "
                             f"{total_steps / steps_per_epoch:g} epochs (THOR's lr reaches 0 there); "
                             f"raise lr_end_epoch")
    lrs = lr_init * (1.0 - epochs / lr_end_epoch) ** lr_decay
    # the two late halvings sharpen the end of the curve, as in the zoo's recipe
    lrs = np.where(epochs >= halving_epoch, lrs * 0.5, lrs)
    lrs = np.where(epochs >= halving_epoch + 1, lrs * 0.5, lrs)
    return lrs.astype(np.float32)


def create_thor_damping_schedule(*, damping_init: float, damping_decay: float, steps_per_epoch: int,
                                 total_steps: int, start_step: int = 0) -> np.ndarray:
    """THOR's per-step damping for steps [start_step, total_steps): damping_init * damping_decay **
    (e / 10) at epoch e = (step + 1) / steps_per_epoch (one factor of damping_decay per 10 epochs)."""
    epochs = _step_epochs(steps_per_epoch, total_steps, start_step)
    if damping_init <= 0 or not 0 < damping_decay <= 1:
        raise UserInputError(f"THOR needs damping_init > 0 and 0 < damping_decay <= 1, got {damping_init} and "
                             f"{damping_decay}")
    return (damping_init * damping_decay ** (epochs / 10.0)).astype(np.float32)
