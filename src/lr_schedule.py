"""Learning-rate schedules as pure functions returning one float32 value per training step.

Every schedule warms up linearly from `lr_init` to `lr_max` over `warmup_steps`, then decays
from `lr_max` towards `lr_end` by its rule. `start_step` cuts the front off, so a resumed run
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


def create_lr_schedule(mode: str, *, lr_init: float, lr_max: float, lr_end: float,
                       total_steps: int, warmup_steps: int = 0, start_step: int = 0,
                       milestones: Sequence[int] = (), gamma: float = 0.1,
                       power: float = 2.0) -> np.ndarray:
    """Per-step learning rates for steps [start_step, total_steps).

    mode: constant | linear | cosine | poly | steps | step (the model zoo's four fixed steps). `milestones` (in steps) and `gamma` drive
    'steps': lr_max * gamma ** (number of milestones <= step). `power` drives 'poly'.
    """
    if mode not in LR_DECAY_MODES:
        raise UserInputError(f"unknown lr_decay_mode '{mode}'; choose one of {', '.join(LR_DECAY_MODES)}")
    if not 0 <= warmup_steps <= total_steps:
        raise UserInputError(f"warmup of {warmup_steps} steps does not fit in {total_steps} steps; "
                             f"lower warmup_epochs")
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
