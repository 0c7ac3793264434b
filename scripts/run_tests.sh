#!/usr/bin/env bash
# Set up .venv with the test requirements and run the whole test suite (extra args go to pytest).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh" "$ROOT/requirements-dev.txt"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest tests "$@"
