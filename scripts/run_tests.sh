#!/usr/bin/env bash
# Set up .venv with the test requirements, lint (ruff, pyproject.toml), and run the whole test suite
# (extra args go to pytest; test files among them run alone).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh" "$ROOT/requirements-dev.txt"
cd "$ROOT"
# The suite's ~300 processes import the same modules: the first writes their bytecode for the rest
# (setup_env.sh installs none; with PYTHONDONTWRITEBYTECODE set each would compile MindSpore's anew).
unset PYTHONDONTWRITEBYTECODE
"$ROOT/.venv/bin/ruff" check --quiet . || { echo "error: ruff found the problems above; fix them (ruff check --fix . fixes import order)" >&2; exit 1; }
# pytest-xdist: one worker per core (at most 5). A third worker on 2 cores filled the seconds tests
# wait on subprocesses and clusters (34 s less wall) but cost 8% more CPU in contention
# (docs/testing.md); the suite's CPU goal is the tighter one.
# --dist loadscope keeps a module on one worker, so its module fixtures (trained checkpoints) run once;
# the longest modules go first (tests/conftest.py, LONGEST_FIRST).
WORKERS=$(nproc); (( WORKERS <= 5 )) || WORKERS=5
# Test files or folders among the arguments (a tier, e.g. docs/aarch64.md's) replace the whole of tests/.
WHERE=(tests)
for arg in "$@"; do [[ $arg == -* || ! -e ${arg%%::*} ]] || { WHERE=(); break; }; done
exec "$ROOT/.venv/bin/python" -m pytest -n "$WORKERS" --dist loadscope --no-loadscope-reorder ${WHERE[@]+"${WHERE[@]}"} "$@"
