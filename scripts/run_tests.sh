#!/usr/bin/env bash
# Set up .venv with the test requirements, lint (ruff, pyproject.toml), and run the whole test suite
# (extra args go to pytest).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh" "$ROOT/requirements-dev.txt"
cd "$ROOT"
"$ROOT/.venv/bin/ruff" check --quiet . || { echo "error: ruff found the problems above; fix them (ruff check --fix . fixes import order)" >&2; exit 1; }
# pytest-xdist: one worker more than the cores (at most 5): many tests spend seconds waiting on a
# subprocess, a signal or a cluster to form, and the extra worker keeps the cores busy meanwhile.
# --dist loadscope keeps a module on one worker, so its module fixtures (trained checkpoints) run once;
# the longest modules go first (tests/conftest.py, LONGEST_FIRST).
WORKERS=$(( $(nproc) + 1 )); (( WORKERS <= 5 )) || WORKERS=5
exec "$ROOT/.venv/bin/python" -m pytest -n "$WORKERS" --dist loadscope --no-loadscope-reorder tests "$@"
