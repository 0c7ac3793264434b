#!/usr/bin/env bash
# An emulated arm64 machine (Debian bookworm, Python 3.11, QEMU user mode) with this checkout in it.
# usage: bash tools/aarch64_shell.sh            an interactive shell in /project inside it
#        bash tools/aarch64_shell.sh 'COMMAND'  run one command line there and exit with its code
# The first call builds the root file system (~10 minutes on 2 cores: debootstrap, then Python and a
# compiler); later calls reuse it. Each call copies the checkout in first (tracked and untracked files
# that git does not ignore), keeping the machine's own .venv, data and build outputs, so the README's
# commands run there as written. Under emulation MindSpore runs 25-5,000x slower (docs/aarch64.md).
# Needs root (chroot, mounts, apt-get); the machine lives in $AARCH64_ROOT (default /var/tmp/resnet-aarch64).
set -euo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 0
fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MACHINE=${AARCH64_ROOT:-/var/tmp/resnet-aarch64}
STAMP="$MACHINE/.resnet-aarch64-ready"
die() { echo "error: $*" >&2; exit 2; }

[[ $(id -u) == 0 ]] || die "the emulated machine needs root (chroot and mounts); run it with sudo"
[[ $(uname -m) != aarch64 ]] || die "this host is aarch64 already: run the README's commands here directly"

install_host_tools() {
    local missing=()
    command -v qemu-aarch64-static >/dev/null || missing+=(qemu-user-static)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    command -v update-binfmts >/dev/null || missing+=(binfmt-support)
    command -v rsync >/dev/null || missing+=(rsync)
    if ((${#missing[@]})); then
        echo "installing on the host: ${missing[*]}"
        apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
            die "apt-get could not install ${missing[*]} (they are Debian packages: apt-get install ${missing[*]})"
    fi
}

enable_binfmt() {
    [[ -e /proc/sys/fs/binfmt_misc/status ]] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc ||
        die "cannot mount binfmt_misc (the kernel needs CONFIG_BINFMT_MISC to run arm64 programs under QEMU)"
    [[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]] || update-binfmts --enable qemu-aarch64 ||
        die "update-binfmts could not register qemu-aarch64"
}

debian_mirror() {   # the host's own Debian mirror, so the machine installs from the same place
    local uri
    uri=$(grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | grep -v security | head -n 1)
    [[ -n $uri ]] || uri=$(grep -hE '^deb ' /etc/apt/sources.list 2>/dev/null | awk '{print $2}' | head -n 1)
    echo "${uri:-http://deb.debian.org/debian}"
}

build_machine() {
    local mirror
    mirror=$(debian_mirror)
    echo "building the arm64 machine in $MACHINE from $mirror (about 10 minutes)"
    rm -rf "$MACHINE"
    debootstrap --arch=arm64 --foreign bookworm "$MACHINE" "$mirror" >/dev/null ||
        die "debootstrap failed (see $MACHINE/debootstrap/debootstrap.log)"
    cp /usr/bin/qemu-aarch64-static "$MACHINE/usr/bin/"
    chroot "$MACHINE" /debootstrap/debootstrap --second-stage >/dev/null ||
        die "debootstrap's second stage failed (see $MACHINE/debootstrap/debootstrap.log)"
    echo "deb $mirror bookworm main" > "$MACHINE/etc/apt/sources.list"
    mount_machine
    chroot "$MACHINE" /bin/bash -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends python3.11 python3.11-venv python3-pip g++ gcc libc6-dev libjpeg-dev git \
        ca-certificates procps >/dev/null' || die "apt-get inside the machine failed"
    date -u +%FT%TZ > "$STAMP"
}

# proc, sys and dev for the programs inside; the host's pip configuration, its constraints file and
# local package folders, and its CA certificates, so pip inside reaches the same index as the host.
mount_machine() {
    local path
    mountpoint -q "$MACHINE/proc" || mount -t proc proc "$MACHINE/proc"
    mountpoint -q "$MACHINE/sys" || mount --rbind /sys "$MACHINE/sys"
    mountpoint -q "$MACHINE/dev" || mount --rbind /dev "$MACHINE/dev"
    cp -L /etc/resolv.conf "$MACHINE/etc/resolv.conf" 2>/dev/null || true
    mkdir -p "$MACHINE/etc/ssl/certs"
    [[ -f /etc/ssl/certs/ca-certificates.crt ]] && cp -L /etc/ssl/certs/ca-certificates.crt "$MACHINE/etc/ssl/certs/"
    for path in /etc/pip.conf /etc/xdg/pip /root/.config/pip /root/.pip; do
        [[ -e $path ]] || continue
        mkdir -p "$MACHINE$(dirname "$path")"
        cp -rL "$path" "$MACHINE$(dirname "$path")/"
    done
    for path in $(pip_local_folders); do
        mkdir -p "$MACHINE$path"
        mountpoint -q "$MACHINE$path" || { mount --bind "$path" "$MACHINE$path" && mount -o remount,bind,ro "$MACHINE$path"; }
    done
}

pip_local_folders() {   # file:// indexes and find-links folders named by pip's configuration or PIP_* variables
    { cat /etc/pip.conf /etc/xdg/pip/pip.conf /root/.config/pip/pip.conf /root/.pip/pip.conf 2>/dev/null
      env | grep -E '^PIP_(FIND_LINKS|EXTRA_INDEX_URL|INDEX_URL)=' || true; } |
        grep -oE '(file://)?/[^ ="]+' | sed 's#^file://##' | while read -r path; do
            while [[ $path != / && ! -d $path ]]; do path=$(dirname "$path"); done
            [[ $path == / || $path == /etc* || $path == /root* ]] || echo "$path"
        done | sed -E 's#^(/[^/]+/[^/]+).*#\1#' | sort -u
}

copy_checkout() {
    mkdir -p "$MACHINE/project"
    # the files of the work tree as it is: a tracked file deleted but not yet committed is left out
    (cd "$REPO" && git ls-files -co --exclude-standard -z |
        while IFS= read -r -d '' file; do if [[ -e $file ]]; then printf '%s\0' "$file"; fi; done) |
        rsync -a --delete --from0 --files-from=- --filter='P /.venv/' --filter='P /data/' --filter='P /output/' \
              --filter='P *.so' --filter='P /.git/' "$REPO/" "$MACHINE/project/"
    # a tree of its own for git (the tests read `git ls-files`), made once; the files above stay as copied
    [[ -d $MACHINE/project/.git ]] || chroot "$MACHINE" /bin/bash -c 'cd /project && git init -q && git add -A'
    chroot "$MACHINE" /bin/bash -c 'cd /project && git add -A >/dev/null 2>&1' || true
}

install_host_tools
enable_binfmt
[[ -f $STAMP ]] || build_machine
mount_machine
copy_checkout
export HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
if (($#)); then
    exec chroot "$MACHINE" /bin/bash -c "cd /project && $*"
fi
exec chroot "$MACHINE" /bin/bash -c 'cd /project && exec /bin/bash -i'
