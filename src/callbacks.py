"""Training callbacks: progress logging with throughput and ETA."""
import time
from typing import Callable, Optional, Sequence

import numpy as np
from mindspore.train import Callback


def _loss_value(outputs) -> float:
    """The loss from a train step's outputs (a tensor, or a tuple led by it under loss scaling)."""
    if isinstance(outputs, (tuple, list)):
        outputs = outputs[0]
    return float(np.mean(outputs.asnumpy()))


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


class TrainMonitor(Callback):
    """Logs every `log_interval` steps: epoch, step, loss, lr, img/s and ETA; then an epoch summary.

    `global_batch` is the number of images one step consumes across all ranks; `lrs` the
    per-step learning rates of the whole schedule."""

    def __init__(self, *, steps_per_epoch: int, total_steps: int, global_batch: int,
                 lrs: Sequence[float], log_interval: int = 10,
                 log: Callable[[str], None] = print):
        super().__init__()
        self.steps_per_epoch = steps_per_epoch
        self.total_steps = total_steps
        self.global_batch = global_batch
        self.lrs = lrs
        self.log_interval = max(1, log_interval)
        self.log = log
        self.window_start: Optional[float] = None
        self.window_steps = 0
        self.epoch_start = 0.0
        self.epoch_losses = []
        self.run_start = 0.0
        self.steps_done = 0

    def on_train_begin(self, run_context) -> None:
        self.run_start = time.time()

    def on_train_epoch_begin(self, run_context) -> None:
        self.epoch_start = time.time()
        self.window_start = self.epoch_start
        self.window_steps = 0
        self.epoch_losses = []

    def on_train_step_end(self, run_context) -> None:
        params = run_context.original_args()
        step = params.cur_step_num  # global, 1-based
        loss = _loss_value(params.net_outputs)
        self.epoch_losses.append(loss)
        self.window_steps += 1
        self.steps_done += 1
        step_in_epoch = (step - 1) % self.steps_per_epoch + 1
        if step_in_epoch % self.log_interval and step_in_epoch != self.steps_per_epoch:
            return
        now = time.time()
        images_per_second = self.window_steps * self.global_batch / max(now - self.window_start, 1e-9)
        seconds_per_step = (now - self.run_start) / self.steps_done
        eta = seconds_per_step * (self.total_steps - step)
        lr = float(self.lrs[min(step - 1, len(self.lrs) - 1)])
        self.log(f"epoch {params.cur_epoch_num} step {step_in_epoch}/{self.steps_per_epoch} "
                 f"loss {loss:.4f} lr {lr:.6f} {images_per_second:.1f} img/s eta {format_duration(eta)}")
        self.window_start, self.window_steps = now, 0

    def on_train_epoch_end(self, run_context) -> None:
        params = run_context.original_args()
        seconds = time.time() - self.epoch_start
        images = len(self.epoch_losses) * self.global_batch
        self.log(f"epoch {params.cur_epoch_num} done: mean loss {np.mean(self.epoch_losses):.4f} "
                 f"time {seconds:.1f}s {images / max(seconds, 1e-9):.1f} img/s")
