#!/usr/bin/env bash
# Evaluate a checkpoint in the foreground; the log is tee'd next to the checkpoint.
usage() {
    cat <<USAGE
usage: bash scripts/run_eval.sh [DATASET_PATH] [CHECKPOINT_PATH] [CONFIG_PATH] [--KEY VALUE ...]

  DATASET_PATH     CIFAR-10 binary folder, a folder of class folders or their MindRecord shards (val/ is used if present)
  CHECKPOINT_PATH  a .ckpt written by train.py, or a model-zoo ResNet checkpoint
  CONFIG_PATH      the yaml the checkpoint was trained with (default: config/resnet50_cifar10.yaml),
                   also one of the model zoo's config files
  --dry_run        print the evaluation command and exit

The last stdout line is a JSON object with top_1_accuracy, top_5_accuracy, loss, samples.
Exit code: the evaluation process's.
USAGE
}
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
[[ ${1:-} == -h || ${1:-} == --help ]] && { usage; exit 0; }
[[ $# -ge 2 && ${1:0:2} != -- && ${2:0:2} != -- ]] || { usage >&2; die "DATASET_PATH and CHECKPOINT_PATH are required"; }
DATASET_PATH=$1; CHECKPOINT_PATH=$2; shift 2
CONFIG_PATH="$ROOT/config/resnet50_cifar10.yaml"
if [[ $# -ge 1 && ${1:0:2} != -- ]]; then CONFIG_PATH=$1; shift; fi
DRY_RUN=0
OVERRIDES=()
for arg in "$@"; do
    if [[ $arg == --dry_run ]]; then DRY_RUN=1; else OVERRIDES+=("$arg"); fi
done
ARGS=(--config_path "$CONFIG_PATH" --data_path "$DATASET_PATH" --eval_dataset_path "$DATASET_PATH"
      --checkpoint_file_path "$CHECKPOINT_PATH" "${OVERRIDES[@]}")
if [[ $DRY_RUN -eq 1 ]]; then show "$PY" "$ROOT/eval.py" "${ARGS[@]}"; exit 0; fi
require_env
[[ -d $DATASET_PATH ]] || die "dataset folder not found: $DATASET_PATH"
[[ -f $CHECKPOINT_PATH ]] || die "checkpoint not found: $CHECKPOINT_PATH"
[[ -f $CONFIG_PATH ]] || die "config file not found: $CONFIG_PATH"

LOG="$(dirname "$CHECKPOINT_PATH")/eval_$(date +%Y%m%d_%H%M%S).log"
run_logged "$LOG" "$PY" "$ROOT/eval.py" "${ARGS[@]}"
