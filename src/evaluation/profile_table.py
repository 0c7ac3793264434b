"""MindSpore's profiler output read for the user: the operators that took the most time per step.

The profiler summarizes operator times by type in a CSV: on CPU
`FRAMEWORK/cpu_op_type_info_<rank>.csv` (op_type, type_occurrences, execution_frequency(per-step),
total_compute_time in ms, ...), on Ascend `ASCEND_PROFILER_OUTPUT/op_statistic.csv` (OP Type,
Core Type, Count, Total Time(us), ...; the device-side summary, read to the documented columns but
not exercised here, where there is no Ascend). The trace (`trace_view.json`) is in Chrome's trace
format: Perfetto (ui.perfetto.dev), chrome://tracing or MindStudio Insight open it."""
import csv
import glob
import io
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

TOP_OPERATORS = 10


@dataclass(frozen=True)
class OperatorTime:
    """One operator type over the profiled steps."""
    op_type: str
    calls_per_step: float
    ms_per_step: float
    share: float  # of all operator time


def find_summary(folder: str) -> Optional[str]:
    """The operator summary the profiler wrote under `folder`: the device's where there is one,
    else the host's (CPU); None when the profiler wrote neither."""
    for pattern in ("**/ASCEND_PROFILER_OUTPUT/op_statistic*.csv", "**/FRAMEWORK/cpu_op_type_info_*.csv"):
        found = sorted(glob.glob(os.path.join(folder, pattern), recursive=True))
        if found:
            return found[-1]
    return None


def read_summary(path: str, steps: int) -> List[OperatorTime]:
    """Every operator type of the summary at `path`, covering `steps` profiled steps, most time first."""
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    if rows and "OP Type" in rows[0]:  # Ascend: calls and microseconds over all profiled steps
        named = [(r["OP Type"], float(r["Count"]), float(r["Total Time(us)"]) / 1000) for r in rows]
    else:  # CPU: milliseconds over all profiled steps
        named = [(r["op_type"], float(r["type_occurrences"]), float(r["total_compute_time"])) for r in rows]
        custom = custom_operators(path.replace("cpu_op_type_info_", "cpu_op_detail_info_"))
        if custom:  # this repository's CPU layers (MindSpore Custom ops), by the cell that runs them
            named = [row for row in named if row[0] != "Custom"] + custom
    merged = {}
    for op_type, calls, ms in named:  # one type may come once per core type
        total_calls, total_ms = merged.get(op_type, (0.0, 0.0))
        merged[op_type] = (total_calls + calls, total_ms + ms)
    total = sum(ms for _, ms in merged.values()) or 1.0
    steps = max(steps, 1)
    table = [OperatorTime(op_type, calls / steps, ms / steps, ms / total) for op_type, (calls, ms) in merged.items()]
    return sorted(table, key=lambda row: -row.ms_per_step)


def custom_operators(detail_path: str) -> List[tuple]:
    """(op type, calls, ms) of the Custom operators in the CPU profiler's per-operator file, named
    by the cell class that runs them, backward apart: 'Custom:OneDnnConv2d', 'Custom:OneDnnConv2d
    backward' (src/cpu_layers's layers); 'Custom:top cell' for those of the graph's own cell (the
    training step's optimizer and gradient check). Empty when the file is not there or has none."""
    if not os.path.isfile(detail_path):
        return []
    totals = {}
    with open(detail_path, newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            if row.get("op_type") != "Custom":
                continue
            scopes = row["full_op_name"].split("/")
            cell = next((scope.rsplit("-", 1)[1] for scope in reversed(scopes[:-1]) if "-" in scope), "top cell")
            name = f"Custom:{cell}" + (" backward" if scopes[0] == "Gradients" else "")
            calls, ms = totals.get(name, (0.0, 0.0))
            totals[name] = (calls + float(row["op_occurrences"]), ms + float(row["op_total_time(ms)"]))
    return [(name, calls, ms) for name, (calls, ms) in totals.items()]


def operator_lines(rows: Sequence[OperatorTime], *, steps: int, wait_share: Optional[float]) -> List[str]:
    """The table as log lines, led by the profiled steps' split between waiting for data and computing."""
    lines = [f"profiler: the {len(rows)} operators that took the most time over {steps} profiled steps"
             + (f" (the steps waited for data {wait_share:.0%} of their time, computed {1 - wait_share:.0%})"
                if wait_share is not None else "")]
    lines.append(f"  {'operator':<28} {'calls/step':>10} {'ms/step':>10} {'share':>7}")
    for row in rows:
        lines.append(f"  {row.op_type:<28} {row.calls_per_step:>10.1f} {row.ms_per_step:>10.3f} {row.share:>7.1%}")
    return lines


def table_csv(rows: Sequence[OperatorTime]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["op_type", "calls_per_step", "ms_per_step", "share"])
    writer.writerows([row.op_type, f"{row.calls_per_step:.6g}", f"{row.ms_per_step:.6g}", f"{row.share:.6g}"]
                     for row in rows)
    return buffer.getvalue()


def table_markdown(rows: Sequence[OperatorTime], *, wait_share: Optional[float]) -> str:
    """The table for TensorBoard's text panel (it renders Markdown)."""
    head = (f"Profiled steps: waiting for data {wait_share:.1%}, computing {1 - wait_share:.1%}.\n\n"
            if wait_share is not None else "")
    lines = ["| operator | calls/step | ms/step | share |", "|---|---:|---:|---:|"]
    lines += [f"| {row.op_type} | {row.calls_per_step:.1f} | {row.ms_per_step:.3f} | {row.share:.1%} |" for row in rows]
    return head + "\n".join(lines)
