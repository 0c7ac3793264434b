"""The suite's work per test module, from the JSON lines tests/conftest.py writes when
RESNET_TESTS_WORK names a file, as a Markdown table (docs/testing.md):

    RESNET_TESTS_WORK=/tmp/work.jsonl bash scripts/run_tests.sh && python tests/work_table.py /tmp/work.jsonl

Given two files (a run before a change and one after), it prints both side by side; with
--tests N, the N tests that cost the most CPU time instead (files written since per-test records);
with --runs, the entry-point runs summed per entry point, finished and refused apart.
"""
import argparse
import json
from collections import defaultdict
from typing import List

KEYS = ("tests", "cpu_s", "wall_s", "runs", "trainings")


def row(name: str, work: dict) -> str:
    return "| " + " | ".join([name] + [f"{work[key]:.0f}" for key in KEYS]) + " |"


def read(path: str) -> dict:
    """module -> its work summed over the file's records (one per module and worker)."""
    totals = defaultdict(lambda: dict.fromkeys(KEYS, 0.0))
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            for key in KEYS:
                totals[record["module"]][key] += record[key]
    totals["all"] = {key: sum(work[key] for work in list(totals.values())) for key in KEYS}
    return totals


def table(path: str) -> str:
    totals = read(path)
    every = totals.pop("all")
    lines = ["| module | tests | CPU s | wall s | entry-point runs | of them trainings |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [row(module, work) for module, work in sorted(totals.items(), key=lambda item: -item[1]["cpu_s"])]
    lines.append(row("all", every))
    return "\n".join(lines)


def comparison(before_path: str, after_path: str) -> str:
    """CPU seconds, entry-point runs and trainings per module, before -> after."""
    before, after = read(before_path), read(after_path)
    lines = ["| module | tests | CPU s | entry-point runs | of them trainings |", "|---|---:|---:|---:|---:|"]
    for module in sorted(after, key=lambda name: (name == "all", -after[name]["cpu_s"])):
        old = before.get(module, dict.fromkeys(KEYS, 0.0))
        lines.append("| " + " | ".join([module] + [
            f"{old[key]:.0f} -> {after[module][key]:.0f}" if round(old[key]) != round(after[module][key])
            else f"{after[module][key]:.0f}" for key in ("tests", "cpu_s", "runs", "trainings")]) + " |")
    return "\n".join(lines)


def costliest(path: str, count: int) -> str:
    """The `count` tests that cost the most CPU seconds (their module fixtures included)."""
    with open(path, encoding="utf-8") as handle:
        records: List[dict] = [json.loads(line) for line in handle]
    tests = sorted((r for r in records if "test" in r), key=lambda r: -r["cpu_s"])[:count]
    lines = ["| test | CPU s | wall s | entry-point runs |", "|---|---:|---:|---:|"]
    lines += [f"| {r['test']} | {r['cpu_s']:.1f} | {r['wall_s']:.1f} | {r['runs']} |" for r in tests]
    return "\n".join(lines)


def runs_per_entry(path: str) -> str:
    """Entry-point runs per entry point: how many finished (exit 0) and how many refused or failed,
    and the CPU seconds of each kind (files written since per-run records)."""
    totals = defaultdict(lambda: {"finished": 0, "finished_s": 0.0, "refused": 0, "refused_s": 0.0})
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            for run in json.loads(line).get("run_list", []):
                kind = "finished" if run["returncode"] == 0 else "refused"
                totals[run["entry"]][kind] += 1
                totals[run["entry"]][f"{kind}_s"] += run["cpu_s"]
    lines = ["| entry point | finished runs | CPU s | refused or failed runs | CPU s |", "|---|---:|---:|---:|---:|"]
    for entry, work in sorted(totals.items(), key=lambda item: -item[1]["finished_s"] - item[1]["refused_s"]):
        lines.append(f"| {entry} | {work['finished']} | {work['finished_s']:.0f} | {work['refused']} | "
                     f"{work['refused_s']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="one record file, or two: before and after")
    parser.add_argument("--tests", type=int, default=0, help="list the N costliest tests of the last file")
    parser.add_argument("--runs", action="store_true", help="the entry-point runs per entry point of the last file")
    args = parser.parse_args()
    if args.runs:
        print(runs_per_entry(args.files[-1]))
    elif args.tests:
        print(costliest(args.files[-1], args.tests))
    else:
        print(comparison(*args.files[:2]) if len(args.files) > 1 else table(args.files[0]))
