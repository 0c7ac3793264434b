"""What a training-parity run leaves: steps.csv, gradients.csv, weights.csv, layers.csv, loss.png,
final.ckpt and final.pth in its folder, and its verdict: the JSON summary and the line that says it."""
import csv
import io
import os
from typing import Dict, List, Optional

import mindspore as ms

from src.files import atomic_target, write_atomic
from src.migration.convert_torch import write_pth
from src.migration.layer_diff import LayerRow

# A loss floor above this: PyTorch's own float32 and float64 runs parted (rounding amplified).
CHAOTIC_FLOOR = 1e-2

Rows = List[Dict[str, object]]


def write_csv(path: str, rows: Rows) -> None:
    """The rows as CSV, atomically; no rows: no file (not an earlier run's)."""
    if not rows:
        if os.path.exists(path):
            os.remove(path)
        return
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, text.getvalue())


def plot_losses(path: str, rows: Rows) -> None:
    """Both loss curves, and their relative difference beside the float32 floor on a log scale."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    steps = [row["step"] for row in rows]
    figure, (curves, gaps) = plt.subplots(1, 2, figsize=(10, 4))
    curves.plot(steps, [row["loss_torch"] for row in rows], "o-", label="PyTorch")
    curves.plot(steps, [row["loss_mindspore"] for row in rows], "x--", label="MindSpore")
    curves.set(xlabel="step", ylabel="loss", title="training loss")
    curves.legend()
    gaps.semilogy(steps, [max(row["rel_diff"], 1e-12) for row in rows], "x-", label="MindSpore vs PyTorch")
    gaps.semilogy(steps, [row["floor"] for row in rows], "--", label="float32 floor (vs float64)")
    gaps.set(xlabel="step", ylabel="relative difference", title="loss difference")
    gaps.legend()
    figure.subplots_adjust(wspace=0.3, bottom=0.15)
    figure.savefig(path, dpi=80)
    plt.close(figure)


def write_tables(folder: str, tables: Dict[str, Rows], layers: Rows, *, plot: bool) -> None:
    """steps.csv, gradients.csv, weights.csv, layers.csv and (with `plot`) loss.png."""
    write_csv(os.path.join(folder, "steps.csv"), tables["steps"])
    write_csv(os.path.join(folder, "gradients.csv"), tables["gradients"])
    write_csv(os.path.join(folder, "weights.csv"), tables["weights"])
    write_csv(os.path.join(folder, "layers.csv"), layers)
    if plot:
        plot_losses(os.path.join(folder, "loss.png"), tables["steps"])


def save_final(folder: str, net, step_cell, model_state) -> None:
    """final.ckpt (the network, and its EMA as ema.*) and final.pth, each written whole or not at all."""
    params = [{"name": p.name, "data": p} for p in net.get_parameters()]
    if getattr(step_cell, "use_ema", False):
        params += [{"name": p.name, "data": p} for p in step_cell.ema_params]
    with atomic_target(os.path.join(folder, "final.ckpt")) as staged:
        ms.save_checkpoint(params, staged)
    write_pth(model_state, os.path.join(folder, "final.pth"))


def chaotic_note(steps: Rows) -> Optional[str]:
    """A note for the log when PyTorch's own float32 and float64 runs parted in the loss (None if not)."""
    floor = steps[-1]["floor"]
    if floor <= CHAOTIC_FLOOR:
        return None
    return (f"note: PyTorch's own float32 and float64 runs ended {floor:.2g} apart in the loss: this training "
            f"amplifies rounding (small batches and feature maps make BatchNorm's statistics ill-conditioned, a "
            f"high lr makes it chaotic), so differences of that size are expected and only their ratio to the "
            f"floor says something; a larger batch or image, or a lower lr_max, calms it")


def parity_summary(tables: Dict[str, Rows], *, arch: str, mode: str, multiple: float, first_bad: Optional[int],
                   differing: Optional[LayerRow], output_dir: str) -> Dict[str, object]:
    """The run's JSON summary; `ok` when no step failed and every gradient, weight and state (the
    final and EMA weights too) is within `multiple` x its floor."""
    compared = tables["gradients"] + tables["weights"]
    worst = max(compared, key=lambda r: r["ratio"] if r["ratio"] != "" else float("inf"))
    beyond = [f"{r['what']}: {r['name']}" for r in compared if not r["within"]]
    return {
        "ok": first_bad is None and not beyond, "arch": arch, "steps": len(tables["steps"]), "mode": mode,
        "multiple": multiple, "first_bad_step": first_bad,
        "first_difference": differing.name if differing else None,
        "max_loss_ratio": max(r["ratio"] for r in tables["steps"]),
        "worst_tensor": f"{worst['what']}: {worst['name']}", "worst_tensor_ratio": worst["ratio"],
        "tensors_within": len(compared) - len(beyond), "tensors": len(compared), "tensors_beyond": beyond[:20],
        "final_loss": {"mindspore": tables["steps"][-1]["loss_mindspore"],
                       "torch": tables["steps"][-1]["loss_torch"]},
        "output_dir": output_dir}


def verdict_line(summary: Dict[str, object], differing: Optional[LayerRow]) -> str:
    """The run's verdict in one line: OK, FAIL in a later tensor only, or FAIL from a step (and its layer)."""
    multiple, compared = summary["multiple"], summary["tensors"]
    beyond_count, beyond = compared - summary["tensors_within"], summary["tensors_beyond"]
    if summary["ok"]:
        return (f"train parity: OK: {summary['steps']} steps, every loss within {multiple:g} x its float32 floor "
                f"(largest {summary['max_loss_ratio']:.2f} x), {summary['tensors_within']} of {compared} "
                f"gradients/weights/states within")
    if summary["first_bad_step"] is None:  # every loss within, but a later weight, EMA or state is not
        return (f"train parity: FAIL: every loss within, but {beyond_count} of {compared} gradients/weights/states "
                f"beyond {multiple:g} x their floor: {', '.join(beyond[:5])}" + (" ..." if beyond_count > 5 else "")
                + " (see weights.csv)")
    where = (f"first layer that differs: {differing.name} ({differing.kind}; {differing.worst()})" if differing
             else "no single layer differs on its own (see layers.csv)")
    return (f"train parity: FAIL from step {summary['first_bad_step']}; {where}; {beyond_count} of {compared} "
            f"gradients/weights/states beyond")
