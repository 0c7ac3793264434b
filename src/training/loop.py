"""Around Model.train: the callbacks, a resumed epoch's rest, the run's end (the best checkpoint's
report among it), the replay of a diverged step and the TensorBoard start."""
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np
from mindspore.train import Model

from src.collective import barrier, rank_sum
from src.config import Config
from src.data.image_decode import partial_decoder
from src.dataset import create_train_dataset, first_batch, host_batches
from src.device import available_cores
from src.evaluation.report import class_names_for, evaluate_with_report, save_report
from src.training.board import Board, batch_picture, target_captions
from src.training.callbacks import (
    CheckpointSaver,
    EvalMonitor,
    ProfilerMonitor,
    RecordPlotter,
    SaveSchedule,
    StepCounter,
    TrainMonitor,
    write_final_state,
)
from src.training.checkpoint import BEST_NAME, load_into_network
from src.training.factory import create_ema_twin, real_sink
from src.training.faults import DivergenceGuard, GracefulStop, divergence_hints
from src.training.loss import loss_from_config
from src.training.nonfinite import NonFinite, replay_micro_batches, write_replay
from src.training.rank_statistics import RankStatistics, rank_statistics
from src.training.resume import best_top1, mark_finished, resume_command
from src.training.run_record import RunRecord
from src.training.step_time import StepClock, input_bound_hints


def create_callbacks(cfg: Config, *, net, model: Model, folder: str, rank: int, writer: bool, group_size: int,
                     steps_per_epoch: int, lrs: np.ndarray, first_step: int, eval_dataset,
                     record: Optional[RunRecord], board: Optional[Board], log, bad_samples,
                     argv: Sequence[str], local_ranks: int = 1, convolutions: str = "mindspore") -> list:
    """Logging, evaluation, checkpoints, the run record and profiling; files from the `writer`
    ranks only (rank 0, or each node's first rank with node-local storage).
    The step clock's two halves enclose the rest (the time between them is the wait for data);
    the divergence guard comes next (nothing after it sees NaN weights at an epoch end), then, with
    several ranks, the one that makes their BatchNorm statistics equal (the evaluation and the
    checkpoints after it see one network), the stop-signal handler last but the clock (it stops
    after the step's or the epoch's other work)."""
    ema_params = model.train_network.ema_params if cfg.model_ema else None
    clock = StepClock()
    guard = DivergenceGuard(patience=cfg.nan_patience, steps_per_epoch=steps_per_epoch, lrs=lrs,
                            skips_overflow=cfg.loss_scale_type == "dynamic", first_step=first_step,
                            hints=divergence_hints(clip_grad_norm=cfg.clip_grad_norm,
                                                  loss_scale_type=cfg.loss_scale_type))
    hints = input_bound_hints(workers=cfg.num_parallel_workers, worker_kind=cfg.data_worker_kind,
                              cores_per_process=available_cores() / max(1, local_ranks),
                              jpeg_folder=cfg.dataset != "cifar10", native_decoder=partial_decoder() is not None)
    statistics = rank_statistics(net, ema_params=ema_params, rank=rank, group_size=group_size,
                                 schedule=save_schedule(cfg, steps_per_epoch, first_step), first_step=first_step)
    callbacks = [clock.start, guard] + ([statistics] if statistics else [])
    callbacks.append(TrainMonitor(steps_per_epoch=steps_per_epoch, total_steps=len(lrs),
                                  global_batch=cfg.batch_size * cfg.grad_accumulation_steps * group_size, lrs=lrs,
                                  log_interval=cfg.log_interval, first_step=first_step, record=record, log=log,
                                  bad_samples=bad_samples.count if bad_samples else None, clock=clock,
                                  input_bound_hints=hints, sink_queue=real_sink(cfg)))
    if eval_dataset is not None:
        ema_net = create_ema_twin(cfg, net, convolutions) if cfg.model_ema else None
        callbacks.append(EvalMonitor(net=net, ema_net=ema_net,
                                     ema_params=ema_params, dataset=eval_dataset, num_classes=cfg.class_num,
                                     group_size=group_size, epoch_size=cfg.epoch_size, steps_per_epoch=steps_per_epoch,
                                     eval_start_epoch=cfg.eval_start_epoch, eval_interval=cfg.eval_interval,
                                     best_folder=folder if cfg.save_best_ckpt and writer else None,
                                     best_top1=best_top1(folder) if first_step else -1.0, record=record, log=log))
    saver = None
    if writer:
        saver = CheckpointSaver(folder=folder, net_name=cfg.net_name,
                                schedule=save_schedule(cfg, steps_per_epoch, first_step),
                                keep=cfg.keep_checkpoint_max, before_save=guard.check_weights, log=log)
        callbacks += [saver] + ([RecordPlotter(record)] if cfg.plot_curves else [])
    if cfg.enable_profiling:
        callbacks.append(ProfilerMonitor(folder=os.path.join(folder, "profiler", f"rank{rank}"),
                                         device_target=cfg.device_target, steps=cfg.profile_steps, clock=clock,
                                         board=board, log=log, first_step=first_step))
    callbacks.append(graceful_stop(cfg, steps_per_epoch=steps_per_epoch, first_step=first_step, saver=saver,
                                   record=record, group_size=group_size, log=log, argv=argv, statistics=statistics))
    callbacks.append(clock.stop)
    return callbacks


def save_schedule(cfg: Config, steps_per_epoch: int, first_step: int) -> SaveSchedule:
    """When the config's periodic checkpoints fall (every rank follows it; the writers save)."""
    return SaveSchedule(steps_per_epoch=steps_per_epoch, epoch_size=cfg.epoch_size,
                        save_epochs=cfg.save_checkpoint_epochs, save_steps=cfg.save_checkpoint_steps,
                        periodic=cfg.save_checkpoint, first_step=first_step)


def graceful_stop(cfg: Config, *, steps_per_epoch: int, first_step: int, saver: Optional[CheckpointSaver],
                  record: Optional[RunRecord], group_size: int, log, argv: Sequence[str],
                  statistics: Optional[RankStatistics] = None) -> GracefulStop:
    """The stop-signal handler. With several ranks, they agree after every step on whether to stop
    (one small allreduce), make their statistics equal (`statistics`) and wait for the writers'
    checkpoints before they exit."""
    def save(run_context, epoch: int, step: int) -> Optional[str]:
        if statistics:  # every rank, at the step they agreed on: the checkpoint holds one network
            statistics.sync(step)
        return saver.save_now(run_context, epoch, step) if saver else None

    return GracefulStop(steps_per_epoch=steps_per_epoch, first_step=first_step,
                        save=save, agree=lambda flag: rank_sum(flag, group_size),
                        barrier=lambda: barrier(group_size),
                        finish=record.plot if record else (lambda: None), resume_hint=resume_command(cfg, argv),
                        sink_mode=real_sink(cfg), log=log)


def train_rest_of_epoch(cfg: Config, model: Model, callbacks: list, *, rank: int, group_size: int, folder: str,
                        first_step: int, steps_per_epoch: int) -> int:
    """Resuming mid-epoch: train the batches of the interrupted epoch after `first_step` (a dataset
    of their own, since MindSpore wants every epoch of one dataset equally long); returns the
    number of epochs done."""
    epoch = first_step // steps_per_epoch
    rest = create_train_dataset(cfg, rank, group_size, folder, start_epoch=epoch,
                                skip_batches=first_step - epoch * steps_per_epoch)
    model.train(epoch + 1, rest, callbacks=callbacks, dataset_sink_mode=False, initial_epoch=epoch)
    for callback in callbacks:  # MindSpore counts steps from 1 again in every train() call
        if isinstance(callback, StepCounter):
            callback.first_step = (epoch + 1) * steps_per_epoch
    return epoch + 1


def end_run(cfg: Config, net, model: Model, eval_dataset, *, folder: str, rank: int, writer: bool, group_size: int,
            steps_per_epoch: int, record: Optional[RunRecord], board: Optional[Board], log,
            evaluated: Optional[tuple] = None) -> List[str]:
    """What a run does after its last checkpoint: each rank's final state, the last curves, the
    report of best.ckpt (`evaluated`: see report_best), the end of the TensorBoard session, and last
    finished.json, which tells a relaunch that nothing is left. The same after training and in a
    relaunch of a run killed after its last checkpoint. Returns what was done, for the log."""
    step = cfg.epoch_size * steps_per_epoch
    write_final_state(net, folder=folder, rank=rank, step=step,
                      ema_params=model.train_network.ema_params if cfg.model_ema else None)
    done = ["the final state"]
    if record and cfg.plot_curves:
        record.plot()
        done.append("the curves")
    if eval_dataset is not None:  # before the session's end: the report's pictures go to TensorBoard too
        report_best(cfg, net, eval_dataset, folder=folder, rank=rank, writer=writer, group_size=group_size,
                    log=log, board=board, step=step, evaluated=evaluated)
        done.append("the report of the best checkpoint" if writer else "its share of the report's evaluation")
    if board:
        board.finished(step)
        done.append("the TensorBoard session")
    barrier(group_size)  # every rank's final state is written before the run is marked finished
    if writer:
        mark_finished(folder, step, cfg.epoch_size)
    return done


def report_best(cfg: Config, net, eval_dataset, *, folder: str, rank: int, writer: bool, group_size: int,
                log, board: Optional[Board] = None, step: int = 0, evaluated: Optional[tuple] = None) -> None:
    """The evaluation report of the run's best.ckpt (of the final weights when there is none) into
    <run folder>/report/, written where the run folder is (by each node's writer with node-local
    storage). Every rank evaluates its shard; each reads best.ckpt from its node's run folder.
    `evaluated`: the (figures, report) of the best.ckpt this process saved, evaluated when it was
    saved (one process only: the ranks of a data-parallel run evaluate together, so all or none)."""
    best = os.path.join(folder, BEST_NAME)
    if evaluated is not None:
        write_best_report(cfg, *evaluated, eval_dataset, folder=folder, weights=best, log=log, board=board, step=step)
        return
    found = rank_sum(int(os.path.isfile(best)), group_size)  # also a barrier: rank 0 has written best.ckpt
    if 0 < found < group_size:
        log(f"no report: {best} is not visible to every rank (put the run folder on a shared file system)")
        return
    if found:  # into the trained network (training is over): no second network to build
        load_into_network(net, best, what=f"{cfg.net_name} with class_num {cfg.class_num}", log=log,
                          use_ema=cfg.model_ema, compression=cfg.compression)  # best.ckpt follows the EMA if any
    result, report = evaluate_with_report(net, eval_dataset, num_classes=cfg.class_num, group_size=group_size)
    if writer:
        write_best_report(cfg, result, report, eval_dataset, folder=folder,
                          weights=best if found else f"the final weights of {folder}", log=log, board=board, step=step)


def write_best_report(cfg: Config, result: dict, report, eval_dataset, *, folder: str, weights: str, log,
                      board: Optional[Board], step: int) -> None:
    """Log the figures of `weights` and write their report into <run folder>/report/."""
    log(f"report of {weights}: top-1 {result['top_1_accuracy']:.4f} top-5 {result['top_5_accuracy']:.4f} "
        f"ECE {result['ece']:.4f} on {result['samples']} images, in {os.path.join(folder, 'report')}")
    written = save_report(os.path.join(folder, "report"), report, source=eval_dataset.sample_source,
                          num_classes=cfg.class_num, title=f"{cfg.net_name} on {cfg.dataset}: {weights}", log=log,
                          pictures=cfg.plot_curves)
    for path in written:
        if board and path.endswith(".png"):
            board.picture_file(f"report/{os.path.splitext(os.path.basename(path))[0]}", path, step)


def replay_configured_step(cfg: Config, net, images: np.ndarray, labels: np.ndarray) -> Tuple[NonFinite, str]:
    """One step's batch replayed on `net` micro-batch by micro-batch and cell by cell, with the config's
    loss, accumulation and loss scale: where it first goes non-finite (src/training/nonfinite.py)."""
    return replay_micro_batches(net, loss_from_config(cfg), images, labels, parts=cfg.grad_accumulation_steps,
                                loss_scale=cfg.loss_scale if cfg.loss_scale_type != "none" else 1.0)


def replay_divergence(cfg: Config, net, step: int, *, rank: int, group_size: int, folder: str) -> str:
    """Replay global step `step` cell by cell on the weights before it (the train step did not apply
    it): where it first went non-finite, also written to nonfinite_rank<r>.json in the run folder."""
    try:
        images, labels = host_batches(cfg, rank, group_size, first=step - 1, count=1)[0]
        result, which = replay_configured_step(cfg, net, images, labels)
        path = write_replay(result, folder, f"nonfinite_rank{rank}.json")
    except Exception as err:  # pylint: disable=broad-except  # the divergence message must survive
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"the replay of step {step} failed ({reason})"
    others = " (the other ranks' batches: their nonfinite_rank<r>.json)" if result.finite and group_size > 1 else ""
    return f"replayed step {step}{f' ({which})' if which else ''}: {result.describe()}{others} ({path})"


def start_board(cfg: Config, board: Board, dataset, *, rank: int, group_size: int) -> None:
    """A new run's TensorBoard record begins with its config (the HParams table, with the last
    evaluation figures beside it) and its first training batch as the network sees it."""
    board.hyperparameters(cfg.to_dict(), metrics=["eval/top_1", "eval/top_5", "eval/loss", "eval/ece", "train/loss"])
    pixels, targets = first_batch(cfg, rank, group_size)
    names = class_names_for(dataset.sample_source, cfg.class_num)
    board.image("data/first_batch", batch_picture(pixels, target_captions(targets, names)), 0)
