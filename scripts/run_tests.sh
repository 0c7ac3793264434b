#!/usr/bin/env bash
# Set up .venv with the test requirements, lint (ruff, pyproject.toml), and run the whole test suite
# (extra args go to pytest).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh" "$ROOT/requirements-dev.txt"
cd "$ROOT"
"$ROOT/.venv/bin/ruff" check --quiet . || { echo "error: ruff found the problems above; fix them (ruff check --fix . fixes import order)" >&2; exit 1; }
exec "$ROOT/.venv/bin/python" -m pytest tests "$@"
