#!/usr/bin/env bash
# Train on one device in the foreground; the log is tee'd into the run folder.
usage() {
    cat <<USAGE
usage: bash scripts/run_standalone_train.sh [DATASET_PATH] [CONFIG_PATH] [--KEY VALUE ...]

  DATASET_PATH  CIFAR-10 binary folder (cifar-10-batches-bin) or a folder of class folders
  CONFIG_PATH   a yaml file from config/ (default: config/resnet50_cifar10.yaml)
  --KEY VALUE   any config key, e.g. --device_target CPU --epoch_size 1

The run folder is <output_dir>/<net_name>/<dataset>; the log is written there as train_<time>.log.
Exit code: the training process's.
USAGE
}
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
[[ ${1:-} == -h || ${1:-} == --help ]] && { usage; exit 0; }
[[ $# -ge 1 && ${1:0:2} != -- ]] || { usage >&2; die "DATASET_PATH is required"; }
DATASET_PATH=$1; shift
CONFIG_PATH="$ROOT/config/resnet50_cifar10.yaml"
if [[ $# -ge 1 && ${1:0:2} != -- ]]; then CONFIG_PATH=$1; shift; fi
require_env
[[ -d $DATASET_PATH ]] || die "dataset folder not found: $DATASET_PATH"
[[ -f $CONFIG_PATH ]] || die "config file not found: $CONFIG_PATH"

ARGS=(--config_path "$CONFIG_PATH" --data_path "$DATASET_PATH" "$@")
RUN_DIR=$(resolve_run_dir "${ARGS[@]}") || exit $?
mkdir -p "$RUN_DIR" || die "cannot create run folder $RUN_DIR"
LOG="$RUN_DIR/train_$(date +%Y%m%d_%H%M%S).log"
echo "log: $LOG"
run_logged "$LOG" "$PY" "$ROOT/train.py" "${ARGS[@]}"
