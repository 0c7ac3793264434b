"""The suite's work per test module, from the JSON lines tests/conftest.py writes when
RESNET_TESTS_WORK names a file, as a Markdown table (docs/testing.md):

    RESNET_TESTS_WORK=/tmp/work.jsonl bash scripts/run_tests.sh && python tests/work_table.py /tmp/work.jsonl
"""
import json
import sys
from collections import defaultdict

KEYS = ("tests", "cpu_s", "wall_s", "runs", "trainings")


def row(name: str, work: dict) -> str:
    return "| " + " | ".join([name] + [f"{work[key]:.0f}" for key in KEYS]) + " |"


def table(path: str) -> str:
    totals = defaultdict(lambda: dict.fromkeys(KEYS, 0.0))
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            for key in KEYS:
                totals[record["module"]][key] += record[key]
    lines = ["| module | tests | CPU s | wall s | entry-point runs | of them trainings |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [row(module, work) for module, work in sorted(totals.items(), key=lambda item: -item[1]["cpu_s"])]
    lines.append(row("all", {key: sum(work[key] for work in totals.values()) for key in KEYS}))
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1]))
