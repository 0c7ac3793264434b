#!/usr/bin/env bash
# Train on one device in the foreground; the log is tee'd into the run folder.
usage() {
    cat <<USAGE
usage: bash scripts/run_standalone_train.sh [DATASET_PATH] [CONFIG_PATH] [RESUME_CKPT] [--KEY VALUE ...]
       bash scripts/run_standalone_train.sh [DATASET_PATH] [CONFIG_PATH] [RUN_EVAL EVAL_DATASET_PATH [RESUME_CKPT]] ...

  DATASET_PATH  CIFAR-10 binary folder (cifar-10-batches-bin), a folder of class folders, or their MindRecord shards
  CONFIG_PATH   a yaml file from config/ (default: config/resnet50_cifar10.yaml) or a model-zoo config file
  RESUME_CKPT   optional: continue from this train.py checkpoint (--resume_ckpt)
  RUN_EVAL EVAL_DATASET_PATH  optional: evaluate during training on this data (the model zoo's form)
  --KEY VALUE   any config key, e.g. --device_target CPU --epoch_size 1
  --dry_run     print the training command and exit

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
zoo_trailing_args "$@"; shift "$ZOO_COUNT"
DRY_RUN=0
OVERRIDES=()
for arg in "$@"; do
    if [[ $arg == --dry_run ]]; then DRY_RUN=1; else OVERRIDES+=("$arg"); fi
done
ARGS=(--config_path "$CONFIG_PATH" --data_path "$DATASET_PATH" "${ZOO_ARGS[@]}" "${OVERRIDES[@]}")
if [[ $DRY_RUN -eq 1 ]]; then show "$PY" "$ROOT/train.py" "${ARGS[@]}"; exit 0; fi
require_env
[[ -d $DATASET_PATH ]] || die "dataset folder not found: $DATASET_PATH"
[[ -f $CONFIG_PATH ]] || die "config file not found: $CONFIG_PATH"

RUN_DIR=$(resolve_run_dir "${ARGS[@]}") || exit $?
mkdir -p "$RUN_DIR" || die "cannot create run folder $RUN_DIR"
LOG="$RUN_DIR/train_$(date +%Y%m%d_%H%M%S).log"
echo "log: $LOG"
run_logged "$LOG" "$PY" "$ROOT/train.py" "${ARGS[@]}"
