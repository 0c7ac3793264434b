#!/usr/bin/env bash
# Set up .venv with the test requirements, lint (ruff, pyproject.toml), and run the whole test suite
# (extra args go to pytest).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh" "$ROOT/requirements-dev.txt"
cd "$ROOT"
"$ROOT/.venv/bin/ruff" check --quiet . || { echo "error: ruff found the problems above; fix them (ruff check --fix . fixes import order)" >&2; exit 1; }
# pytest-xdist: one worker per core (at most 4: each test may start training processes of its own);
# --dist loadscope keeps a module on one worker, so its module fixtures (trained checkpoints) run once;
# the longest modules go first (tests/conftest.py, LONGEST_FIRST).
# Tests marked `alone` (msrun ranks) take the whole machine: see tests/conftest.py, share_of_machine.
exec "$ROOT/.venv/bin/python" -m pytest -n auto --maxprocesses 4 --dist loadscope --no-loadscope-reorder tests "$@"
