"""Where each training step's time goes: waiting for the next batch, or running the step.

MindSpore's `Model.train` takes the next batch from the input pipeline between one step's last
callback and the next step's first, so the time between those two hooks is the wait for data,
and the rest (the step and its callbacks) is running. On a device in dataset sink mode the steps
of a sink run on the device without the host between them; there the depth of the device's data
queue tells the same (`data_queue_depth`)."""
import time
from typing import Callable, Optional, Tuple

from mindspore.train import Callback

# An epoch that waited for its batches more than this share of its step time is input-bound: a
# faster pipeline would make it at least 1 / (1 - 0.25) = 1.33x faster. A pipeline that keeps up
# hands over ready batches, and the wait stays within a few percent.
INPUT_BOUND_SHARE = 0.25


class StepClock:
    """Accumulates, over the whole run, the seconds spent waiting for batches and running steps.
    Put `start` first and `stop` last in the callback list."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.waiting = self.running = 0.0
        self.last_end: Optional[float] = None  # when the previous step's last callback returned
        self.began: Optional[float] = None  # when the current step's first callback was called
        self.start, self.stop = _ClockStart(self), _ClockStop(self)

    def totals(self) -> Tuple[float, float]:
        """(waiting, running) seconds so far; a step under way counts up to now."""
        running = self.running + (self.clock() - self.began if self.began is not None else 0.0)
        return self.waiting, running

    def epoch_begins(self) -> None:
        self.last_end = self.clock()  # the time between epochs (evaluation, saving) is neither

    def step_begins(self) -> None:
        now = self.clock()
        if self.last_end is not None:
            self.waiting += now - self.last_end
        self.began = now

    def step_ends(self) -> None:
        now = self.clock()
        if self.began is not None:
            self.running += now - self.began
        self.began, self.last_end = None, now


class _ClockStart(Callback):
    def __init__(self, clock: StepClock):
        super().__init__()
        self.clock = clock

    def on_train_epoch_begin(self, run_context) -> None:
        self.clock.epoch_begins()

    def on_train_step_begin(self, run_context) -> None:
        self.clock.step_begins()


class _ClockStop(Callback):
    def __init__(self, clock: StepClock):
        super().__init__()
        self.clock = clock

    def on_train_step_end(self, run_context) -> None:
        self.clock.step_ends()


def wait_share(before: Tuple[float, float], after: Tuple[float, float]) -> float:
    """The share of the time between two `StepClock.totals()` spent waiting for data."""
    waiting, running = after[0] - before[0], after[1] - before[1]
    return waiting / max(waiting + running, 1e-9)


def data_queue_depth(run_context) -> Optional[int]:
    """The batches waiting in the device's data queue (dataset sink mode on Ascend/GPU), from
    MindSpore's `DatasetHelper.get_mbuf_queue_size`; None where it is not exposed (CPU, no sink).
    Not exercised here: this machine has no device queue."""
    helper = getattr(run_context.original_args(), "dataset_helper", None)
    try:
        return int(helper.get_mbuf_queue_size()) if helper is not None else None
    except (AttributeError, RuntimeError, TypeError):
        return None


def input_bound_hints(*, workers: int, worker_kind: str, cores_per_process: float, jpeg_folder: bool,
                      native_decoder: bool) -> str:
    """What to do about an input-bound run, for its configuration."""
    hints = [f"raise num_parallel_workers (now {workers}; this host has {cores_per_process:g} core(s) per "
             f"training process)"]
    if worker_kind != "process":
        hints.append("try data_worker_kind process (transforms in worker processes, not threads)")
    if jpeg_folder and not native_decoder:
        hints.append("build the native JPEG decoder (bash scripts/setup_env.sh; it needs cc and libjpeg-dev)")
    if workers >= cores_per_process:
        hints.append("or give each training process more cores (fewer processes per host)")
    return "; ".join(hints)


def input_bound_line(epoch: int, share: float, hints: str) -> str:
    return (f"input-bound: epoch {epoch} waited for its batches {share:.0%} of the step time (over "
            f"{INPUT_BOUND_SHARE:.0%}); the input pipeline is slower than the step: {hints}")
