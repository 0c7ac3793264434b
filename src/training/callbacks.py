"""Training callbacks: progress logs, evaluation during training, checkpoints and the run record.

Steps are global: a resumed run starts counting at `first_step` (the checkpoint's step), because
MindSpore's own step counter restarts at 1 in every process."""
import csv
import hashlib
import json
import math
import os
import time
from typing import Callable, Optional, Sequence

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn
from mindspore.train import Callback

from src.evaluation.profile_table import (
    TOP_OPERATORS,
    find_summary,
    operator_lines,
    read_summary,
    table_csv,
    table_markdown,
)
from src.evaluation.report import evaluate_with_report
from src.files import warn_if_low_space, write_atomic
from src.training.checkpoint import (
    BEST_NAME,
    EMA_PREFIX,
    NonFiniteWeightsError,
    checkpoint_name,
    ema_part,
    list_checkpoints,
    rotate,
    save_atomic,
)
from src.training.run_record import RunRecord
from src.training.step_time import INPUT_BOUND_SHARE, StepClock, data_queue_depth, input_bound_line, wait_share

# A run's curves are redrawn at most this often (and at its end): a user watching sees them within
# a minute, and runs of short epochs do not spend their time drawing.
PLOT_EVERY_SECONDS = 60.0


def loss_value(outputs) -> float:
    """The loss from a train step's outputs (a tensor, or a tuple led by it under loss scaling)."""
    if isinstance(outputs, (tuple, list)):
        outputs = outputs[0]
    return float(np.mean(outputs.asnumpy()))


def step_figures(outputs) -> dict:
    """The loss scale and (when the step clips) the gradient norm from a train step's outputs
    `(loss, overflow, loss_scale[, grad_norm])`; none for a step that returns the loss alone."""
    if not isinstance(outputs, (tuple, list)) or len(outputs) < 3:
        return {}
    figures = {"loss_scale": float(np.mean(outputs[2].asnumpy()))}
    if len(outputs) > 3:
        figures["grad_norm"] = float(np.mean(outputs[3].asnumpy()))
    return figures


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


class StageProgress:
    """Progress lines, as training logs its steps, for a stage that trains before training starts
    (SCOP's knockoff stage: the shipped recipes ask 90 epochs of it)."""

    def __init__(self, name: str, total_steps: int, log_interval: int, log: Callable[[str], None]):
        self.name, self.total_steps, self.log_interval, self.log = name, total_steps, max(1, log_interval), log
        self.start = self.window_time = time.perf_counter()
        self.window_images = 0

    def __call__(self, step: int, images: int, loss: Tensor, lr: float) -> None:
        """After step `step` (from 1) of `images` images ended with `loss`: a line every log_interval
        steps and at the last (step, loss, lr, images a second, time left)."""
        self.window_images += images
        if step % self.log_interval and step != self.total_steps:
            return
        now = time.perf_counter()
        rate = self.window_images / max(now - self.window_time, 1e-9)
        left = (now - self.start) / step * (self.total_steps - step)
        self.log(f"{self.name} step {step}/{self.total_steps} loss {float(loss.asnumpy()):.4f} lr {lr:.6f} "
                 f"{rate:.1f} img/s eta {format_duration(left)}")
        self.window_time, self.window_images = now, 0


class StepCounter(Callback):
    """Base for callbacks that need the global step and the step within the epoch."""

    def __init__(self, steps_per_epoch: int, first_step: int = 0):
        super().__init__()
        self.steps_per_epoch = steps_per_epoch
        self.first_step = first_step

    def global_step(self, run_context) -> int:
        return self.first_step + run_context.original_args().cur_step_num

    def step_in_epoch(self, step: int) -> int:
        return (step - 1) % self.steps_per_epoch + 1

    def lr_at(self, run_context, lrs: Sequence[float], *, last_applied: bool = True) -> float:
        """The lr of the optimizer's last applied update (`last_applied`), or of the update it
        would apply next, by the optimizer's own count of applied updates: a step skipped for
        non-finite gradients does not advance it, so the callback's step count would run ahead.
        Networks without that count (THOR's) fall back on the callback's step."""
        updates = applied_updates(run_context)
        if updates is None:
            index = self.global_step(run_context) - 1
        else:
            index = updates - 1 if last_applied else updates
        return float(lrs[min(max(index, 0), len(lrs) - 1)])


def applied_updates(run_context) -> Optional[int]:
    """The optimizer's `global_step` (updates applied so far), or None where there is none."""
    optimizer = getattr(run_context.original_args().train_network, "optimizer", None)
    count = getattr(optimizer, "global_step", None)
    return int(count.asnumpy().reshape(-1)[0]) if isinstance(count, Parameter) else None


class TrainMonitor(StepCounter):
    """Logs every `log_interval` steps (or every sink): epoch, step, loss, lr, img/s, ETA; records
    the same values in the run record; summarizes each epoch.

    `global_batch` is the number of images one step consumes across all ranks; `lrs` is the
    whole schedule, indexed by global step; `bad_samples(epoch)` counts the unreadable samples
    replaced in an epoch (1-based), for the epoch summary and the record. With a `clock`, every
    line gives the share of the time spent waiting for data, and an epoch that waited more than
    INPUT_BOUND_SHARE says so with `input_bound_hints`; with `sink_queue`, lines give the depth of
    the device's data queue."""

    def __init__(self, *, steps_per_epoch: int, total_steps: int, global_batch: int, lrs: Sequence[float],
                 log_interval: int = 10, first_step: int = 0, record: Optional[RunRecord] = None,
                 log: Callable[[str], None] = print, bad_samples: Optional[Callable[[int], int]] = None,
                 clock: Optional[StepClock] = None, input_bound_hints: str = "", sink_queue: bool = False):
        super().__init__(steps_per_epoch, first_step)
        self.total_steps = total_steps
        self.global_batch = global_batch
        self.lrs = lrs
        self.log_interval = max(1, log_interval)
        self.record = record
        self.log = log
        self.bad_samples = bad_samples
        self.wall_offset = record.wall_time_offset if record else 0.0
        self.run_start = self.window_time = self.epoch_start = time.time()
        self.window_step = self.logged_step = first_step
        self.epoch_losses = []
        self.clock, self.input_bound_hints, self.sink_queue = clock, input_bound_hints, sink_queue
        self.window_clock = self.epoch_clock = clock.totals() if clock else None

    def on_train_begin(self, run_context) -> None:
        self.run_start = self.window_time = time.time()

    def on_train_epoch_begin(self, run_context) -> None:
        # The epoch's first window starts here: the last one ended before the epoch-end evaluation
        # and checkpoints, whose time would read as a slow start of every epoch.
        self.epoch_start = self.window_time = time.time()
        self.epoch_losses = []
        if self.clock:
            self.window_clock = self.epoch_clock = self.clock.totals()

    def on_train_step_end(self, run_context) -> None:
        params = run_context.original_args()
        step = self.global_step(run_context)
        loss = loss_value(params.net_outputs)
        self.epoch_losses.append(loss)
        at_epoch_end = self.step_in_epoch(step) == self.steps_per_epoch
        if step - self.logged_step < self.log_interval and not at_epoch_end:
            return
        now = time.time()
        images_per_second = (step - self.window_step) * self.global_batch / max(now - self.window_time, 1e-9)
        seconds_per_step = (now - self.run_start) / max(step - self.first_step, 1)
        lr = self.lr_at(run_context, self.lrs)
        bad = self.bad_samples(params.cur_epoch_num) if self.bad_samples and at_epoch_end else None
        figures = step_figures(params.net_outputs)
        waited = None
        if self.clock:
            totals = self.clock.totals()
            waited, self.window_clock = wait_share(self.window_clock, totals), totals
        queue = data_queue_depth(run_context) if self.sink_queue else None
        self.log(f"epoch {params.cur_epoch_num} step {self.step_in_epoch(step)}/{self.steps_per_epoch} "
                 f"loss {loss:.4f} lr {lr:.6f} {images_per_second:.1f} img/s "
                 + (f"data wait {waited:.0%} " if waited is not None else "")
                 + (f"data queue {queue} " if queue is not None else "")
                 + f"eta {format_duration(seconds_per_step * (self.total_steps - step))}")
        if self.record:
            self.record.add(epoch=params.cur_epoch_num, step=step, loss=loss, lr=lr,
                            img_per_s=round(images_per_second, 2),
                            wall_time=round(self.wall_offset + now - self.run_start, 3), bad_samples=bad,
                            data_wait=None if waited is None else round(waited, 4), **figures)
        self.window_time, self.window_step, self.logged_step = now, step, step

    def on_train_epoch_end(self, run_context) -> None:
        params = run_context.original_args()
        seconds = time.time() - self.epoch_start
        images = self.steps_per_epoch * self.global_batch
        bad = self.bad_samples(params.cur_epoch_num) if self.bad_samples else 0
        waited = wait_share(self.epoch_clock, self.clock.totals()) if self.clock else None
        self.log(f"epoch {params.cur_epoch_num} done: mean loss {np.mean(self.epoch_losses):.4f} "
                 f"time {seconds:.1f}s {images / max(seconds, 1e-9):.1f} img/s"
                 + (f", waiting for data {waited:.0%} of it" if waited is not None else "")
                 + (f"; {bad} unreadable sample(s) replaced" if bad else ""))
        if waited is not None and waited > INPUT_BOUND_SHARE:
            self.log(input_bound_line(params.cur_epoch_num, waited, self.input_bound_hints))


class EvalMonitor(Callback):
    """Evaluates after epoch `eval_start_epoch`, then every `eval_interval` epochs (and after the
    last); keeps `best.ckpt` (with its epoch and top-1 inside) when `best_folder` is given.

    With `ema_params` (the train step's EMA of the weights), the EMA is loaded into `ema_net` and
    evaluated too; best.ckpt then follows the EMA top-1 and holds the EMA weights beside the raw.
    The record gets the evaluation at the epoch's last global step (`steps_per_epoch`, not the
    batch count of MindSpore's current train() call: a mid-epoch resume trains a shorter one).
    `best_evaluation` keeps the (figures, report) of the best.ckpt this run saved, so its report
    needs no second evaluation after training."""

    def __init__(self, *, net: nn.Cell, dataset, num_classes: int, group_size: int, epoch_size: int,
                 steps_per_epoch: int, eval_start_epoch: int = 1, eval_interval: int = 1,
                 best_folder: Optional[str] = None, best_top1: float = -1.0, record: Optional[RunRecord] = None,
                 log: Callable[[str], None] = print, ema_net: Optional[nn.Cell] = None,
                 ema_params: Optional[Sequence[Parameter]] = None):
        super().__init__()
        self.net, self.dataset, self.num_classes, self.group_size = net, dataset, num_classes, group_size
        self.ema_net, self.ema_params = ema_net, ema_params
        self.epoch_size, self.steps_per_epoch = epoch_size, steps_per_epoch
        self.eval_start_epoch, self.eval_interval = eval_start_epoch, max(1, eval_interval)
        self.best_folder, self.best_top1 = best_folder, best_top1
        self.record, self.log = record, log
        self.best_evaluation: Optional[tuple] = None

    def due(self, epoch: int) -> bool:
        if epoch < self.eval_start_epoch:
            return False
        return (epoch - self.eval_start_epoch) % self.eval_interval == 0 or epoch == self.epoch_size

    def _evaluate(self, net: nn.Cell) -> tuple:
        evaluation = evaluate_with_report(net, self.dataset, num_classes=self.num_classes, group_size=self.group_size)
        net.set_train(True)
        return evaluation

    def on_train_epoch_end(self, run_context) -> None:
        params = run_context.original_args()
        epoch = params.cur_epoch_num
        if not self.due(epoch):
            return
        evaluation = self._evaluate(self.net)
        result = evaluation[0]
        line = (f"epoch {epoch} eval: top-1 {result['top_1_accuracy']:.4f} top-5 "
                f"{result['top_5_accuracy']:.4f} loss {result['loss']:.4f} ECE {result['ece']:.4f} on "
                f"{result['samples']} images")
        ema_weights, ema_result = {}, {}
        if self.ema_params is not None:
            # a snapshot (for best.ckpt too), not the live parameters the next step updates
            ema_weights = {p.name: Parameter(Tensor(p.asnumpy()), name=p.name) for p in self.ema_params}
            ms.load_param_into_net(self.ema_net, ema_part(ema_weights), strict_load=True)
            evaluation = self._evaluate(self.ema_net)
            ema_result = evaluation[0]
            line += f"; EMA top-1 {ema_result['top_1_accuracy']:.4f} top-5 {ema_result['top_5_accuracy']:.4f}"
        self.log(line)
        if self.record:
            self.record.add(epoch=epoch, step=epoch * self.steps_per_epoch, loss=result["loss"],
                            top_1=result["top_1_accuracy"], top_5=result["top_5_accuracy"], ece=result["ece"],
                            ema_top_1=ema_result.get("top_1_accuracy"), ema_top_5=ema_result.get("top_5_accuracy"))
        candidate = ema_result or result  # best.ckpt follows the EMA when there is one
        if not math.isfinite(candidate["loss"]):
            self.log(f"epoch {epoch}: evaluation loss is {candidate['loss']}; not a candidate for {BEST_NAME}")
            return
        if self.best_folder and candidate["top_1_accuracy"] > self.best_top1:
            try:
                save_atomic(self.net, os.path.join(self.best_folder, BEST_NAME),
                            append_dict={"epoch_num": epoch, "top_1_accuracy": candidate["top_1_accuracy"],
                                         **ema_weights})
            except NonFiniteWeightsError as err:
                self.log(f"epoch {epoch}: {err}")
                return
            self.best_top1 = candidate["top_1_accuracy"]
            self.best_evaluation = evaluation  # the candidate's: the EMA's when there is one
            self.log(f"epoch {epoch}: new best {'EMA ' if ema_result else ''}top-1 {self.best_top1:.4f}, "
                     f"saved {BEST_NAME}")


class SaveSchedule:
    """When the periodic checkpoints fall, in global steps: at the end of every `save_epochs`-th epoch
    and of the last one, and within an epoch `save_steps` steps after the last save (0: never); none
    with `periodic` False. Bookkeeping alone (`saved(step)` after each save), so that the ranks that
    write nothing can follow the writer's saves (src/training/rank_statistics.py)."""

    def __init__(self, *, steps_per_epoch: int, epoch_size: int, save_epochs: int, save_steps: int = 0,
                 periodic: bool = True, first_step: int = 0):
        self.steps_per_epoch, self.epoch_size = steps_per_epoch, epoch_size
        self.save_epochs, self.save_steps, self.periodic = save_epochs, save_steps, periodic
        self.saved_step = first_step  # a resumed run's checkpoint was the last save

    def due_in_epoch(self, step: int) -> bool:
        """Whether global `step`, not an epoch's last, ends with a checkpoint."""
        at_epoch_end = (step - 1) % self.steps_per_epoch + 1 == self.steps_per_epoch
        return (self.periodic and self.save_steps > 0 and step - self.saved_step >= self.save_steps
                and not at_epoch_end)

    def due_at_epoch_end(self, epoch: int) -> bool:
        """Whether epoch `epoch` (1-based) ends with a checkpoint."""
        return self.periodic and (epoch % self.save_epochs == 0 or epoch == self.epoch_size)

    def saved(self, step: int) -> None:
        self.saved_step = step


class CheckpointSaver(StepCounter):
    """Saves the training state (weights, optimizer slots, counters) when `schedule` says (every
    `save_epochs` epochs, after the last epoch, and every `save_steps` steps if > 0); keeps the newest
    `keep`. With a schedule that is not periodic it saves only when asked (`save_now`, for a stop
    signal). `before_save(run_context)` runs first (the divergence guard's weight check, which stops
    the run rather than save NaN/Inf); a low disk is said before a save."""

    def __init__(self, *, folder: str, net_name: str, schedule: SaveSchedule, keep: int = 10,
                 before_save: Optional[Callable] = None, log: Callable[[str], None] = print):
        super().__init__(schedule.steps_per_epoch, schedule.saved_step)
        self.folder, self.net_name, self.schedule, self.keep = folder, net_name, schedule, keep
        self.before_save, self.log = before_save, log
        self.saved_path = None

    def _last_size(self) -> int:
        found = list_checkpoints(self.folder, self.net_name)
        return max((os.path.getsize(path) for _, _, path in found), default=0)

    def save_now(self, run_context, epoch: int, step: int) -> str:
        """Save the state after global `step` of `epoch` (1-based) unless just saved; returns the file."""
        if step == self.schedule.saved_step and self.saved_path:
            return self.saved_path
        if self.before_save:
            self.before_save(run_context)
        path = os.path.join(self.folder, checkpoint_name(self.net_name, epoch, self.step_in_epoch(step)))
        warn_if_low_space(self.folder, self._last_size(), self.log)
        save_atomic(run_context.original_args().train_network, path,
                    append_dict={"epoch_num": epoch if self.step_in_epoch(step) == self.steps_per_epoch
                                 else epoch - 1, "step_num": step})
        rotate(self.folder, self.net_name, self.keep, self.steps_per_epoch)
        self.schedule.saved(step)
        self.saved_path = path
        return path

    def on_train_step_end(self, run_context) -> None:
        step = self.global_step(run_context)
        if self.schedule.due_in_epoch(step):
            self.save_now(run_context, run_context.original_args().cur_epoch_num, step)

    def on_train_epoch_end(self, run_context) -> None:
        epoch = run_context.original_args().cur_epoch_num
        if self.schedule.due_at_epoch_end(epoch):
            self.save_now(run_context, epoch, self.global_step(run_context))


class RecordPlotter(Callback):
    """Redraws the run record's curves after an epoch (after evaluation and saving) once
    `every_seconds` have passed since the last drawing (the run's end draws them last, in
    src/training/loop.py's end_run). Drawing costs ~0.15 s and loading matplotlib ~1 s: per epoch,
    that was most of a short epoch's time."""

    def __init__(self, record: RunRecord, every_seconds: float = PLOT_EVERY_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.record, self.every_seconds, self.clock = record, every_seconds, clock
        self.drawn_at = clock()

    def on_train_epoch_end(self, run_context) -> None:
        if self.clock() - self.drawn_at >= self.every_seconds:
            self.draw()

    def draw(self) -> None:
        self.record.plot()
        self.drawn_at = self.clock()


def _fingerprint(params: Sequence[Parameter]) -> str:
    digest = hashlib.sha256()
    for param in params:
        digest.update(param.asnumpy().tobytes())
    return digest.hexdigest()


def write_final_state(net: nn.Cell, *, folder: str, rank: int, step: int,
                      ema_params: Optional[Sequence[Parameter]] = None) -> None:
    """Write final_state_rank<r>.json: the global step, a fingerprint of the trainable weights
    (and of their EMA, when `ema_params` are given) and one of the other parameters (BatchNorm
    moving statistics, QAT ranges, with their EMA), so the ranks of a data-parallel run can be
    compared without writing one checkpoint per rank. The ranks move the other parameters with their
    own batches and make them equal at every epoch end (src/training/rank_statistics.py), so after a
    whole run both fingerprints agree across ranks, and equal those of the last checkpoint."""
    trainable = net.trainable_params()
    state = {"rank": rank, "step": step, "trainable_sha256": _fingerprint(trainable)}
    others = [p for p in net.get_parameters() if not p.requires_grad]
    if ema_params is not None:
        averaged = {p.name: p for p in ema_params}
        state["ema_sha256"] = _fingerprint([averaged[EMA_PREFIX + p.name] for p in trainable])
        others += [averaged[EMA_PREFIX + p.name] for p in others]
    state["statistics_sha256"] = _fingerprint(others)
    write_atomic(os.path.join(folder, f"final_state_rank{rank}.json"), json.dumps(state) + "\n")


class ProfilerMonitor(Callback):
    """Runs MindSpore's profiler over `steps` steps after one skipped and one warm-up step, and
    writes its traces under `folder` (trace_view.json, in Chrome's trace format: Perfetto,
    chrome://tracing or MindStudio Insight open it). When those steps are done it stops the
    profiler and logs the operators that took the most time, with the steps' split between waiting
    for data and computing (from `clock`); the table goes to `folder`/top_operators.csv and, with a
    `board`, to TensorBoard's text panel.

    The profiler's schedule counts callbacks; in sink mode (Ascend, GPU) a callback ends a whole
    sink, so the steps the profiled callbacks covered are counted from the run context's step
    number, and the per-step figures are divided by those steps. Reading or writing the report can
    only fail with one warning line: it never ends the training."""

    SKIPPED, WARMUP = 1, 1

    def __init__(self, *, folder: str, device_target: str, steps: int = 5, clock: Optional[StepClock] = None,
                 board=None, log: Callable[[str], None] = print, first_step: int = 0):
        super().__init__()
        self.folder, self.device_target, self.steps, self.first_step = folder, device_target, steps, first_step
        self.clock, self.board, self.log = clock, board, log
        self.profiler = None
        self.calls = 0
        self.clock_before = None
        self.last_step = 0
        self.profiled_steps = 0  # training steps inside the profiled callbacks

    def on_train_begin(self, run_context) -> None:
        if self.calls:  # a second train() call of a resumed run: the profiled steps are done
            return
        from mindspore.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
        activities = [ProfilerActivity.CPU]
        if self.device_target == "Ascend":
            activities.append(ProfilerActivity.NPU)
        elif self.device_target == "GPU":
            activities.append(ProfilerActivity.GPU)
        self.profiler = profile(activities=activities,
                                schedule=schedule(wait=0, warmup=self.WARMUP, active=self.steps, repeat=1,
                                                  skip_first=self.SKIPPED),
                                on_trace_ready=tensorboard_trace_handler(self.folder), start_profile=False)
        self.profiler.start()

    def on_train_step_end(self, run_context) -> None:
        if self.profiler is None:
            return
        step = run_context.original_args().cur_step_num
        covered, self.last_step = step - self.last_step, step  # 1, or a whole sink
        self.profiler.step()
        self.calls += 1
        if self.calls > self.SKIPPED + self.WARMUP:
            self.profiled_steps += covered
        if self.calls == self.SKIPPED + self.WARMUP and self.clock:
            self.clock_before = self.clock.totals()
        if self.calls == self.SKIPPED + self.WARMUP + self.steps:
            self._finish(run_context)

    def on_train_end(self, run_context) -> None:
        if self.profiler is not None:  # the run ended before the profiled steps did
            self._finish(run_context)

    def _finish(self, run_context) -> None:
        share = wait_share(self.clock_before, self.clock.totals()) if self.clock_before else None
        profiler, self.profiler = self.profiler, None
        try:
            profiler.stop()
            if self.profiled_steps > 0:
                self.report(self.first_step + run_context.original_args().cur_step_num, self.profiled_steps, share)
        except (OSError, ValueError, KeyError, RuntimeError, csv.Error) as err:
            self.log(f"warning: the profiler's report was not written ({type(err).__name__}: "
                     f"{str(err).splitlines()[0][:200] if str(err) else ''}); training goes on; its traces are "
                     f"under {self.folder}")

    def report(self, step: int, steps: int, share: Optional[float]) -> None:
        """Log and save the table of the operators that took the most time over `steps` steps."""
        path = find_summary(self.folder)
        if path is None:
            self.log(f"profiler: no operator summary under {self.folder}; open its trace files there")
            return
        rows = read_summary(path, steps)[:TOP_OPERATORS]
        for line in operator_lines(rows, steps=steps, wait_share=share):
            self.log(line)
        write_atomic(os.path.join(self.folder, "top_operators.csv"), table_csv(rows))
        if self.board:
            self.board.text("profiler/top_operators", table_markdown(rows, wait_share=share), step)
