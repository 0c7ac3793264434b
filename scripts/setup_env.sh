#!/usr/bin/env bash
# Create .venv at the repository root (Python 3.11) and install a requirements file into it.
# Idempotent: it reinstalls only when the requirements file changed since the last install.
#   bash scripts/setup_env.sh [REQUIREMENTS_FILE]      (default: requirements.txt)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REQUIREMENTS=${1:-"$ROOT/requirements.txt"}
VENV="$ROOT/.venv"

find_python() {
    for candidate in "${PYTHON:-}" python3.11 python3; do
        [[ -n $candidate ]] || continue
        if command -v "$candidate" >/dev/null 2>&1 &&
           "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
            echo "$candidate"; return 0
        fi
    done
    return 1
}

if [[ ! -x "$VENV/bin/python" ]]; then
    PY=$(find_python) || { echo "error: Python 3.11 not found (MindSpore 2.10 wheels are cp311); install it or set PYTHON=/path/to/python3.11" >&2; exit 2; }
    echo "creating $VENV with $PY"
    "$PY" -m venv "$VENV"
fi

# The stamp covers the file and the files it includes with -r.
stamp_of() {
    local file=$1 dir
    dir=$(dirname "$file")
    cat "$file"
    { grep -E '^-r ' "$file" || true; } | while read -r _ inc; do stamp_of "$dir/$inc"; done
}
STAMP="$VENV/.installed-$(basename "$REQUIREMENTS")"
WANTED=$(stamp_of "$REQUIREMENTS" | sha256sum | cut -d' ' -f1)
if [[ -f $STAMP && $(cat "$STAMP") == "$WANTED" ]]; then
    exit 0
fi
echo "installing $(basename "$REQUIREMENTS") into $VENV"
"$VENV/bin/python" -m pip install --disable-pip-version-check -q -r "$REQUIREMENTS"
echo "$WANTED" > "$STAMP"
