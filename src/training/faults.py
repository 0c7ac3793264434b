"""Faults a long run meets, handled so that nothing good is lost: divergence (NaN/Inf loss or
weights) and a stop signal (a scheduler's SIGTERM, Ctrl-C)."""
import math
import os
import signal
from typing import Callable, Optional, Sequence

import numpy as np

from src.errors import UserInputError
from src.training.callbacks import StepCounter, loss_value
from src.training.checkpoint import non_finite_parameters

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Tests kill a run where a scheduler's kill may land, but at a chosen moment rather than by racing a
# clock: RESNET_KILL_AFTER_STEP=N SIGKILLs every rank once global step N's work is done (its
# evaluation and checkpoint too, at an epoch end) and every rank got there.
KILL_AFTER_STEP = "RESNET_KILL_AFTER_STEP"


class DivergedError(UserInputError):
    """Training produced a non-finite loss or non-finite weights; the message says what to try.
    `step` is the global step whose loss was the last non-finite one (None: the weights were)."""

    def __init__(self, message: str, step: Optional[int] = None):
        super().__init__(message)
        self.step = step


class TrainingStopped(Exception):
    """Raised out of training after a stop signal was handled and the state saved."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def overflow_skipped(outputs) -> bool:
    """True when a train step's outputs `(loss, overflow, loss_scale)` report an overflow."""
    if not isinstance(outputs, (tuple, list)) or len(outputs) < 2:
        return False
    return bool(np.any(outputs[1].asnumpy()))


class DivergenceGuard(StepCounter):
    """Stops the run after `patience` consecutive steps with a non-finite loss or gradients (the train
    step skipped them), or when the weights hold NaN/Inf at an epoch end or before a checkpoint is
    saved (`check_weights`). Under dynamic loss scaling (`skips_overflow`), an overflow step is the
    scaler's business and neither counts nor resets the count. Put it first among the callbacks, so
    it stops the run before any epoch-end checkpoint or evaluation sees the bad weights."""

    def __init__(self, *, patience: int, steps_per_epoch: int, lrs: Sequence[float], skips_overflow: bool,
                 hints: str, first_step: int = 0):
        super().__init__(steps_per_epoch, first_step)
        self.patience, self.lrs, self.skips_overflow, self.hints = patience, lrs, skips_overflow, hints
        self.bad_steps = 0

    def where(self, run_context, skipped: bool = False) -> str:
        step = self.global_step(run_context)
        lr = self.lr_at(run_context, self.lrs, last_applied=not skipped)  # a skipped step's own lr
        return (f"epoch {run_context.original_args().cur_epoch_num} step {self.step_in_epoch(step)}/"
                f"{self.steps_per_epoch} (global step {step}, lr {lr:.6g})")

    def on_train_step_end(self, run_context) -> None:
        outputs = run_context.original_args().net_outputs
        skipped = overflow_skipped(outputs)
        if self.skips_overflow and skipped:
            return
        loss = loss_value(outputs)
        if math.isfinite(loss) and not skipped:
            self.bad_steps = 0
            return
        self.bad_steps += 1
        if self.bad_steps >= self.patience:
            what = f"loss {loss}" if not math.isfinite(loss) else "non-finite gradients"
            applied = " (not applied)" if skipped else ""  # THOR's steps report no overflow: applied
            raise DivergedError(f"training diverged: {what} for {self.bad_steps} consecutive step(s) up to "
                                f"{self.where(run_context, skipped)}{applied}; no checkpoint with NaN/Inf was written; "
                                f"try {self.hints}", step=self.global_step(run_context) if skipped else None)

    def check_weights(self, run_context) -> None:
        """Raise DivergedError when any weight, statistic or optimizer slot holds NaN/Inf (before
        every save, and at every epoch end)."""
        bad = non_finite_parameters(run_context.original_args().train_network)
        if bad:
            raise DivergedError(f"training diverged: {len(bad)} parameter(s) hold NaN/Inf (first {bad[0]}) at "
                                f"{self.where(run_context)}; no checkpoint with NaN/Inf was written; "
                                f"try {self.hints}")

    def on_train_epoch_end(self, run_context) -> None:
        self.check_weights(run_context)


def kill_if_asked(step: int) -> None:
    """SIGKILL this process after global `step` when KILL_AFTER_STEP names it (a test's fault)."""
    if os.environ.get(KILL_AFTER_STEP) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def divergence_hints(*, clip_grad_norm: float, loss_scale_type: str) -> str:
    """What to try after a divergence, naming the config keys to change."""
    hints = ["a lower --lr_max", "more --warmup_epochs"]
    hints.append("a lower --clip_grad_norm" if clip_grad_norm > 0 else "--clip_grad_norm 1.0")
    if loss_scale_type != "dynamic":
        hints.append("--loss_scale_type dynamic")
    return ", ".join(hints)


class GracefulStop(StepCounter):
    """On SIGTERM or SIGINT: finish the current step, save a resumable checkpoint (mid-epoch, or
    the epoch's own after its end-of-epoch work), redraw the record, say how to resume, and raise
    TrainingStopped (the entry point exits with 128 + signal). A second signal kills at once.

    `save(run_context, epoch, step)` saves the training state and returns the file (rank 0), or
    None; `agree(flag)` returns the sum of `flag` over all ranks, so every rank stops after the
    same step; `barrier()` returns once every rank got there (rank 0's file is complete). That
    agreement, after the step's other callbacks on every rank, is also where a test's kill lands
    (`kill_if_asked`)."""

    def __init__(self, *, steps_per_epoch: int, first_step: int, save: Callable, agree: Callable[[int], int],
                 barrier: Callable[[], None], finish: Callable[[], None], resume_hint: str,
                 sink_mode: bool, log: Callable[[str], None] = print):
        super().__init__(steps_per_epoch, first_step)
        self.save, self.agree, self.barrier, self.finish = save, agree, barrier, finish
        self.resume_hint, self.sink_mode, self.log = resume_hint, sink_mode, log
        self.signum = 0

    def install(self) -> None:
        """Take over SIGTERM and SIGINT (call once, in the main thread)."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:  # pylint: disable=unused-argument
        if self.signum:  # the second signal: no more waiting
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        where = "the end of this sink" if self.sink_mode else "the end of this step"
        self.log(f"received {signal.Signals(signum).name}: stopping at {where} and saving a checkpoint "
                 f"(send it again to stop at once)")

    def _stop_requested(self) -> int:
        """The signal to stop for, agreed by every rank (0: go on)."""
        votes = self.agree(self.signum)
        if votes and not self.signum:
            self.signum = int(signal.SIGTERM)  # another rank was signalled
        return self.signum if votes else 0

    def on_train_step_end(self, run_context) -> None:
        step = self.global_step(run_context)
        if self.step_in_epoch(step) == self.steps_per_epoch:
            return  # an epoch end: stop after its evaluation and checkpoint (on_train_epoch_end)
        if self._stop_requested():
            self._stop(run_context, step)
        kill_if_asked(step)

    def on_train_epoch_end(self, run_context) -> None:
        if self._stop_requested():
            self._stop(run_context, self.global_step(run_context))
        kill_if_asked(self.global_step(run_context))

    def _stop(self, run_context, step: int) -> None:
        path = self.save(run_context, run_context.original_args().cur_epoch_num, step)
        self.finish()
        self.barrier()
        at = "mid-epoch" if self.step_in_epoch(step) != self.steps_per_epoch else "end of epoch"
        saved = f"saved {path}; " if path else ""  # only the ranks that write the run folder save
        self.log(f"stopped by {signal.Signals(self.signum).name} after global step {step} ({at}); {saved}"
                 f"resume with: {self.resume_hint}")
        raise TrainingStopped(self.signum)
