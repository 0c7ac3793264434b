"""The run record: metrics.csv (one row per logged step and per evaluation) and curves.png."""
import contextlib
import csv
import os
from typing import Dict, List, Optional

from src.files import atomic_target, write_atomic, write_failure
from src.training.board import Board, scalar_tags

COLUMNS = ["epoch", "step", "loss", "lr", "top_1", "top_5", "img_per_s", "wall_time", "bad_samples", "ema_top_1",
           "ema_top_5", "data_wait", "loss_scale", "grad_norm", "ece"]


class RunRecord:
    """Appends rows to `folder`/metrics.csv and redraws `folder`/curves.png on request.

    On resume, rows past the resumed step are dropped first: those steps are trained again. With a
    `board`, every row goes to TensorBoard too, as the same values."""

    def __init__(self, folder: str, resume_step: Optional[int] = None, board: Optional[Board] = None):
        self.board = board
        self.csv_path = os.path.join(folder, "metrics.csv")
        self.png_path = os.path.join(folder, "curves.png")
        self.rows: List[Dict[str, str]] = []
        if resume_step is not None and os.path.isfile(self.csv_path):
            with open(self.csv_path, newline="", encoding="utf-8") as handle:
                self.rows = [row for row in csv.DictReader(handle) if int(row["step"]) <= resume_step]
        self._rewrite()

    @property
    def wall_time_offset(self) -> float:
        """Wall time already spent by the runs this one continues."""
        times = [float(row["wall_time"]) for row in self.rows if row.get("wall_time")]
        return max(times, default=0.0)

    def _rewrite(self) -> None:
        lines = [",".join(COLUMNS)] + [",".join(row.get(c, "") for c in COLUMNS) for row in self.rows]
        write_atomic(self.csv_path, "\n".join(lines) + "\n")

    def add(self, **values) -> None:
        """Append one row; missing columns stay empty."""
        row = {column: _format(values.get(column)) for column in COLUMNS}
        size = os.path.getsize(self.csv_path) if os.path.exists(self.csv_path) else 0
        try:
            with open(self.csv_path, "a", encoding="utf-8") as handle:
                handle.write(",".join(row[c] for c in COLUMNS) + "\n")
        except OSError as err:
            # A partial row would corrupt the record: cut the file back to its last whole row.
            with contextlib.suppress(OSError):
                os.truncate(self.csv_path, size)
            raise write_failure(self.csv_path, err) from None
        self.rows.append(row)
        if self.board:
            self.board.scalars(int(row["step"]), scalar_tags(row))

    def plot(self) -> None:
        """Draw loss and lr against step, and top-1/top-5 against epoch, into curves.png."""
        # The figure alone, not pyplot: no global figure state, nothing to close, any thread may draw.
        from matplotlib.figure import Figure

        train = [r for r in self.rows if r["loss"] and not r["top_1"]]
        evals = [r for r in self.rows if r["top_1"]]
        figure = Figure(figsize=(15, 4))
        axes = figure.subplots(1, 3)
        axes[0].plot([int(r["step"]) for r in train], [float(r["loss"]) for r in train])
        axes[0].set(title="training loss", xlabel="step")
        axes[1].plot([int(r["step"]) for r in train], [float(r["lr"]) for r in train])
        axes[1].set(title="learning rate", xlabel="step")
        for column in ("top_1", "top_5", "ema_top_1", "ema_top_5"):
            if any(r.get(column) for r in evals):
                axes[2].plot([int(r["epoch"]) for r in evals], [float(r[column]) for r in evals], marker="o",
                             label=column.replace("_", "-").replace("ema-", "EMA "))
        axes[2].set(title="evaluation accuracy", xlabel="epoch", ylim=(0, 1))
        if evals:
            axes[2].legend(loc="lower right")
        # a fixed layout: tight_layout measured the text at 0.2 s an epoch
        figure.subplots_adjust(left=0.04, right=0.99, bottom=0.13, top=0.92, wspace=0.18)
        with atomic_target(self.png_path) as tmp:
            figure.savefig(tmp, dpi=80, format="png")


def _format(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.9g}"
    return str(value)
