"""Does the training recipe still teach? Train a small network with the plain recipe (crop and
flip) and the full one (TrivialAugmentWide, random erasing, mixup/CutMix, label smoothing) over
several seeds on a small real dataset, and print held-out top-1 per epoch with its spread over
seeds. Not a timed test: one run of a heavy recipe swings by 0.2-0.4 top-1 between seeds, so only
the spread over seeds says whether two versions of the code differ.

    python tools/benchmark_learning.py                               # this checkout, digits, seeds 1 2 3
    python tools/benchmark_learning.py --repo . --repo /tmp/old      # side by side with another checkout

Each run is `train.py` of the checkout named by --repo (its own config file and code), so any
version of this repository can be measured against any other on the same data. The default data
are scikit-learn's handwritten digits written as CIFAR-10 binary files (src/data/digits_data.py);
--data_path takes any CIFAR-10 binary folder instead. The last stdout line is one JSON object.
"""
import argparse
import contextlib
import csv
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout this tool is in
RECIPES = {
    "plain": [],
    "full": ["--auto_augment", "ta_wide", "--random_erase", "0.1", "--mixup_alpha", "0.2", "--cutmix_alpha", "1.0",
             "--use_label_smooth", "True", "--label_smooth_factor", "0.1"],
    # the plain recipe in mixed precision: bfloat16 layers on CPUs with AMX (else it stays float32)
    "plain_amp": ["--amp_level", "O2"],
}


def train_command(repo: str, data_path: str, output_dir: str, *, recipe: str, seed: int, epochs: int,
                  net: str, image_size: int, workers: int) -> List[str]:
    """The train.py command line of one run: `net` at `image_size` on CPU, evaluated after every
    epoch; lr 0.02 after one warmup epoch, cosine (the config's 0.1 without warmup swings between
    0.4 and 0.8 top-1 across seeds on the digits even with the plain recipe)."""
    return [sys.executable, os.path.join(repo, "train.py"),
            "--config_path", os.path.join(repo, "config", f"{net}_cifar10.yaml"),
            "--data_path", data_path, "--output_dir", output_dir, "--device_target", "CPU",
            "--train_image_size", str(image_size), "--eval_image_size", str(image_size),
            "--epoch_size", str(epochs), "--warmup_epochs", "1", "--lr_max", "0.02", "--lr_decay_mode", "cosine",
            "--loss_scale_type", "none", "--dataset_sink_mode", "False", "--num_parallel_workers", str(workers),
            "--run_eval", "True", "--eval_interval", "1", "--save_checkpoint_epochs", str(epochs),
            "--seed", str(seed)] + RECIPES[recipe]


def top1_by_epoch(output_dir: str) -> Dict[int, float]:
    """Held-out top-1 of every evaluated epoch, from the run's metrics.csv."""
    paths = glob.glob(os.path.join(output_dir, "**", "metrics.csv"), recursive=True)
    if not paths:
        raise RuntimeError(f"no metrics.csv under {output_dir}")
    with open(paths[0], newline="", encoding="utf-8") as handle:
        return {int(row["epoch"]): float(row["top_1"]) for row in csv.DictReader(handle) if row["top_1"]}


def version_of(repo: str) -> str:
    """The checkout's short commit, with '+' when it has uncommitted changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") or os.path.basename(os.path.abspath(repo))
    return commit + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")


def summarize(values: Sequence[float]) -> Dict[str, float]:
    """Mean, standard deviation (over seeds), min and max."""
    return {"mean": round(statistics.fmean(values), 4),
            "std": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
            "min": round(min(values), 4), "max": round(max(values), 4)}


def print_table(results: Dict[str, Dict[str, Dict[int, Dict[int, float]]]]) -> None:
    """One row per recipe and epoch; per version, the mean +- std over seeds and each seed's top-1."""
    versions = list(results)
    print("recipe  epoch  " + "  ".join(f"{v:>34}" for v in versions))
    recipes = next(iter(results.values()))
    for recipe in recipes:
        epochs = sorted(next(iter(recipes[recipe].values())))
        for epoch in epochs:
            cells = []
            for version in versions:
                runs = results[version][recipe]
                values = [runs[seed][epoch] for seed in sorted(runs)]
                stats = summarize(values)
                cells.append(f"{stats['mean']:.3f}+-{stats['std']:.3f} ({' '.join(f'{v:.3f}' for v in values)})")
            print(f"{recipe:<6}  {epoch:>5}  " + "  ".join(f"{c:>34}" for c in cells))


def run(repo: str, data_path: str, output_dir: str, *, recipe: str, seed: int, epochs: int,
        **settings) -> Dict[int, float]:
    """One training run; its log goes to output_dir/train.log. A run folder that already holds
    every epoch's evaluation is read instead of trained again (so an interrupted benchmark goes
    on where it stopped); one without is this benchmark's own unfinished run, trained anew."""
    with contextlib.suppress(RuntimeError):
        done = top1_by_epoch(output_dir)
        if len(done) == epochs:
            return done
    shutil.rmtree(output_dir, ignore_errors=True)
    os.makedirs(output_dir)
    command = train_command(repo, data_path, output_dir, recipe=recipe, seed=seed, epochs=epochs, **settings)
    with open(os.path.join(output_dir, "train.log"), "w", encoding="utf-8") as log:
        done = subprocess.run(command, cwd=repo, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise RuntimeError(f"training in {repo} failed (exit {done.returncode}); see {output_dir}/train.log")
    return top1_by_epoch(output_dir)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", action="append", help="checkout whose train.py to run (repeat to compare; "
                        "default: this one)")
    parser.add_argument("--data_path", default="", help="CIFAR-10 binary folder (default: the digits, written "
                        "to a temporary folder)")
    parser.add_argument("--recipes", nargs="+", default=["plain", "full"], choices=list(RECIPES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--net", default="resnet18")
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--num_parallel_workers", type=int, default=2)
    parser.add_argument("--output_dir", default="", help="run folders and learning.json (default: a temporary "
                        "folder)")
    args = parser.parse_args(argv)
    for repo in args.repo or []:
        if not os.path.isfile(os.path.join(repo, "train.py")):
            print(f"error: --repo {repo} holds no train.py; pass a checkout of this repository", file=sys.stderr)
            return 2
    try:
        return measure(args)
    except RuntimeError as err:  # a training run failed: its log is named
        print(f"error: {err}", file=sys.stderr)
        return 1


def measure(args: argparse.Namespace) -> int:
    """Every run of every checkout, recipe and seed; the table; the JSON line."""
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="learning_")
    data_path = args.data_path
    if not data_path:
        sys.path.insert(0, ROOT)
        from src.data.digits_data import write_digits
        data_path = write_digits(os.path.join(output_dir, "digits"))
    results: Dict[str, Dict[str, Dict[int, Dict[int, float]]]] = {}
    for repo in args.repo or [ROOT]:
        version = version_of(repo)
        results[version] = {recipe: {} for recipe in args.recipes}
        for recipe in args.recipes:
            for seed in args.seeds:
                folder = os.path.join(output_dir, version, recipe, f"seed{seed}")
                top1 = run(os.path.abspath(repo), data_path, folder, recipe=recipe, seed=seed, epochs=args.epochs,
                           net=args.net, image_size=args.image_size, workers=args.num_parallel_workers)
                results[version][recipe][seed] = top1
                print(f"{version} {recipe} seed {seed}: top-1 by epoch "
                      f"{' '.join(f'{top1[e]:.3f}' for e in sorted(top1))}", flush=True)
    print_table(results)
    final = {version: {recipe: summarize([runs[seed][max(runs[seed])] for seed in runs])
                       for recipe, runs in by_recipe.items()} for version, by_recipe in results.items()}
    with open(os.path.join(output_dir, "learning.json"), "w", encoding="utf-8") as handle:
        json.dump({"results": results, "final": final}, handle, indent=1)
    print(json.dumps({"data_path": data_path, "epochs": args.epochs, "seeds": args.seeds, "final_top_1": final,
                      "output_dir": output_dir}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
