#!/usr/bin/env bash
# Create .venv at the repository root (Python 3.11) and install a requirements file into it.
# Idempotent: it reinstalls only when the requirements file changed since the last install.
#   bash scripts/setup_env.sh [REQUIREMENTS_FILE]      (default: requirements.txt)
set -euo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    echo "usage: bash scripts/setup_env.sh [REQUIREMENTS_FILE]   (default: requirements.txt; requirements-dev.txt adds the test tools)"
    exit 0
fi
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

# libjpeg-turbo's partial JPEG decoder for the ImageNet pipeline (src/data/native/jpeg_crop.c): built
# when missing or older than its source. Without a C compiler and libjpeg's headers the pipeline
# decodes with Pillow instead (slower; see docs/data.md).
DECODER_SOURCE="$ROOT/src/data/native/jpeg_crop.c"
DECODER="$ROOT/src/data/native/libjpeg_crop.so"
if [[ ! -f $DECODER || $DECODER_SOURCE -nt $DECODER ]]; then
    if ${CC:-cc} -O2 -fPIC -shared -fvisibility=hidden "$DECODER_SOURCE" -o "$DECODER.tmp" -ljpeg 2>"$ROOT/src/data/native/build.log"; then
        mv "$DECODER.tmp" "$DECODER"
        rm -f "$ROOT/src/data/native/build.log"
    else
        rm -f "$DECODER.tmp"
        echo "note: the partial JPEG decoder did not build (see src/data/native/build.log; it needs a C compiler and libjpeg-turbo's headers: apt-get install gcc libjpeg-dev); JPEGs will be decoded with Pillow" >&2
    fi
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
# uv installs a new .venv in a sixth of pip's CPU time (~30 CPU-s and 1.5 min here against ~200 and
# 3 min): it downloads and unpacks in parallel and leaves the bytecode to the first import, where pip
# compiles every module of MindSpore and PyTorch. uv reads no pip configuration, so pip's find-links
# (where a local PyTorch CPU wheel may lie) are handed to it. Where uv cannot be had, pip installs.
UV_VERSION=0.13.9
pip_find_links() {
    "$VENV/bin/python" -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | tr ' ' '\n' | sort -u |
        while read -r link; do [[ -n $link ]] && echo "--find-links=$link"; done
}
install_requirements() {
    local links
    if "$VENV/bin/python" -m pip install --disable-pip-version-check -q "uv==$UV_VERSION" 2>/dev/null; then
        mapfile -t links < <(pip_find_links)
        "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" ${links[@]+"${links[@]}"} -r "$REQUIREMENTS" && return 0
        echo "note: uv could not install $(basename "$REQUIREMENTS"); trying pip" >&2
    fi
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q -r "$REQUIREMENTS"
}
if [[ ! -f $STAMP || $(cat "$STAMP") != "$WANTED" ]]; then
    echo "installing $(basename "$REQUIREMENTS") into $VENV"
    install_requirements
    echo "$WANTED" > "$STAMP"
fi

# This repository's CPU convolutions (src/cpu_layers), against the oneDNN just installed: built
# when missing or older than their source. Without g++ training uses MindSpore's convolutions.
bash "$ROOT/src/cpu_layers/native/build.sh" "$VENV" || true
