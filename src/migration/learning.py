"""Learning side by side (train_parity.py --learn): the config's recipe trained for whole epochs in
both frameworks from one seeded state on the same streamed batches, held-out top-1 after each
epoch, over several seeds; and the rule that judges the final epoch."""
import argparse
import json
import os
from typing import Dict, Iterable, Iterator, List

import mindspore as ms
import numpy as np

from src.config import Config
from src.data.host_stage import host_normalize, normalization_of
from src.dataset import create_eval_dataset, iter_host_batches, steps_per_epoch_of
from src.migration.convert_torch import import_torch
from src.migration.dumped_batches import Batch
from src.migration.torch_training import TorchSide
from src.migration.train_sides import create_sides, torch_recipe
from src.training.factory import create_schedule, create_train_step, seed_everything
from src.training.train_step import ReadyInput

# The rule: the final epoch's mean top-1 over the seeds may differ between the frameworks by
# LEARN_SPREADS standard errors of that difference (from each side's spread over the seeds), and
# always by LEARN_FLOOR (one seed has no spread; top-1 on a few hundred images moves in steps of a
# fraction of a percent). Overlapping seed ranges are not enough: one noisy seed makes any two overlap.
LEARN_SPREADS, LEARN_FLOOR = 2.0, 0.02


def held_out(cfg: Config) -> Iterator[Batch]:
    """The evaluation split batch by batch, normalized as both networks see it: float32 NCHW images
    and labels (read anew for each evaluation: ImageNet's does not fit in memory)."""
    for columns in create_eval_dataset(cfg).create_tuple_iterator(num_epochs=1, output_numpy=True):
        yield host_normalize(columns[0], normalization_of(cfg.dataset)), columns[1]


def top1(predict, batches: Iterable[Batch]) -> float:
    """The fraction of `batches`' images whose largest logit of `predict(images)` is their label."""
    correct = total = 0
    for images, labels in batches:
        correct += int((predict(images).argmax(axis=1) == labels).sum())
        total += len(labels)
    return correct / max(total, 1)


def learning_verdict(runs: Dict[int, Dict[str, List[float]]]) -> Dict[str, float]:
    """The rule applied to the last epoch of every seed's curves."""
    last = {side: np.array([curves[side][-1] for curves in runs.values()]) for side in ("mindspore", "torch")}
    seeds = len(runs)
    variance = sum(float(values.var(ddof=1)) if seeds > 1 else 0.0 for values in last.values())
    standard_error = (variance / seeds) ** 0.5
    difference = abs(float(last["mindspore"].mean() - last["torch"].mean()))
    allowed = max(LEARN_SPREADS * standard_error, LEARN_FLOOR)
    return {"mindspore_mean": float(last["mindspore"].mean()), "torch_mean": float(last["torch"].mean()),
            "difference": difference, "standard_error": standard_error, "allowed": allowed,
            "ok": difference <= allowed}


def learn_one_seed(cfg: Config, args: argparse.Namespace, log) -> Dict[str, List[float]]:
    """Both frameworks from one seeded state on the same batches for --learn epochs: top-1 after
    each. Batches stream from the pipeline, as in training."""
    import torch  # noqa: PLC0415
    seed_everything(cfg.seed)
    torch.manual_seed(cfg.seed)
    net, model, _ = create_sides(cfg, args)
    per_epoch = steps_per_epoch_of(cfg)
    lrs = create_schedule(cfg, per_epoch)
    step_cell = create_train_step(cfg, net, lrs, ema=None, input_stage=ReadyInput())
    side = TorchSide.create(model, torch_recipe(cfg, None))
    curves: Dict[str, List[float]] = {"mindspore": [], "torch": []}
    for epoch in range(cfg.epoch_size):
        step_cell.set_train(True)
        for index, (images, labels) in enumerate(iter_host_batches(cfg, 0, 1, first=epoch * per_epoch, count=None)):
            side.step(images, labels, float(lrs[epoch * per_epoch + index]))
            step_cell(ms.Tensor(images), ms.Tensor(labels))
        net.set_train(False)
        side.model.eval()
        with torch.no_grad():
            curves["torch"].append(top1(lambda x: side.model(torch.from_numpy(x)).numpy(), held_out(cfg)))
        curves["mindspore"].append(top1(lambda x: net(ms.Tensor(x)).asnumpy(), held_out(cfg)))
        side.model.train()
        log(f"seed {cfg.seed} epoch {epoch + 1}: top-1 MindSpore {curves['mindspore'][-1]:.4f}, "
            f"PyTorch {curves['torch'][-1]:.4f}")
    return curves


def learn_side_by_side(cfg: Config, args: argparse.Namespace, log) -> int:
    """--learn: the recipe over several seeds in both frameworks; judged by learning_verdict. Prints
    the curves and verdict as one JSON line; returns the exit code (0 within the rule, 1 not)."""
    import_torch()
    if not args.data_given:
        from src.data.digits_data import write_digits  # noqa: PLC0415
        cfg.data_path = write_digits(os.path.join(args.output_dir, "digits"))
        cfg.dataset, cfg.class_num, cfg.eval_dataset_path = "cifar10", 10, ""
        log(f"data: scikit-learn's digits written as CIFAR-10 binary files to {cfg.data_path}")
    cfg.epoch_size = args.learn
    runs = {}
    for seed in args.seeds:
        cfg.seed = seed
        runs[seed] = learn_one_seed(cfg, args, log)
    log(f"{'epoch':>5} {'MindSpore min..max':>20} {'PyTorch min..max':>20}")
    for epoch in range(args.learn):
        spans = {side: (min(r[side][epoch] for r in runs.values()), max(r[side][epoch] for r in runs.values()))
                 for side in ("mindspore", "torch")}
        log(f"{epoch + 1:>5} {spans['mindspore'][0]:>9.4f}..{spans['mindspore'][1]:.4f} "
            f"{spans['torch'][0]:>9.4f}..{spans['torch'][1]:.4f}")
    verdict = learning_verdict(runs)
    log(f"learn: final epoch over {len(runs)} seed(s): mean top-1 MindSpore {verdict['mindspore_mean']:.4f}, "
        f"PyTorch {verdict['torch_mean']:.4f}, difference {verdict['difference']:.4f}; allowed "
        f"{LEARN_SPREADS:g} x its standard error over the seeds ({verdict['standard_error']:.4f}), at least "
        f"{LEARN_FLOOR:g}: "
        f"{verdict['allowed']:.4f}: {'OK' if verdict['ok'] else 'FAIL'}")
    print(json.dumps({"learn": {str(seed): curves for seed, curves in runs.items()}, "verdict": verdict,
                      "ok": verdict["ok"]}), flush=True)
    return 0 if verdict["ok"] else 1
