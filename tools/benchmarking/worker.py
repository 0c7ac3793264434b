"""The subprocess protocol: every measurement runs in a process of its own, benchmark.py started
again with --worker; it answers with one JSON line after REPLY on stdout."""
import argparse
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Sequence

REPLY = "BENCHMARK-REPLY "
# The measuring processes are benchmark.py itself (its hidden --worker flags), run from the repository root.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENTRY = os.path.join(REPO, "benchmark.py")


_STARTED = time.monotonic()


def progress(message: str) -> None:
    """A line on stderr, at once, with the minutes since the benchmark began: a run of many minutes
    into a log file shows where it is (the tables go to stdout at the end)."""
    elapsed = int(time.monotonic() - _STARTED)
    print(f"benchmark [{elapsed // 60}:{elapsed % 60:02d}] {message}", file=sys.stderr, flush=True)


def entry_command(*arguments: str) -> List[str]:
    """The command line that starts benchmark.py with `arguments` in this interpreter."""
    return [sys.executable, ENTRY, *arguments]


def reply(value) -> None:
    """A measuring process's answer: one line on stdout."""
    print(REPLY + json.dumps(value), flush=True)


def reply_of(result: subprocess.CompletedProcess, what: str) -> Dict:
    """The answer of a finished measuring process; an error if it gave none."""
    for line in result.stdout.splitlines():
        if line.startswith(REPLY):
            return json.loads(line[len(REPLY):])
    raise RuntimeError(f"the {what} benchmark process ended without a result (exit {result.returncode})")


def run_worker(command: Sequence[str], what: str) -> Dict:
    """Run a measuring process to its end from the repository root; its answer."""
    return reply_of(subprocess.run(list(command), stdout=subprocess.PIPE, text=True, cwd=REPO), what)


class Worker:
    """The orchestrator's handle on a measuring process."""

    def __init__(self, framework: str, net_name: str, batch: int, size: int, args: argparse.Namespace,
                 extra: Sequence[str] = ()):
        command = entry_command("--worker", framework, "--net", net_name,
                                "--batch_size", str(batch), "--image_size", str(size), "--threads", str(args.threads),
                                "--workers", str(args.workers), "--steps", str(args.steps), "--calls", str(args.calls),
                                "--cpu_isa", args.cpu_isa, *extra)
        self.framework = framework
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        self.first = self._read()

    def _read(self) -> Dict:
        for line in self.process.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        raise RuntimeError(f"the {self.framework} benchmark process ended early (exit {self.process.wait()})")

    def ask(self, command: str) -> Dict:
        """Send one command; its answer."""
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        """Tell the process to quit and wait for it."""
        try:
            if self.process.poll() is None:
                self.process.stdin.write("quit\n")
            self.process.stdin.close()
        except BrokenPipeError:  # it ended on its own; its exit code is what matters
            pass
        self.process.wait()
