#!/usr/bin/env bash
# The demo: set up .venv, write the sample dataset, train ResNet18 on it, evaluate, print top-1/top-5.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    echo "usage: bash scripts/run_demo.sh [--images_per_class N] [--KEY VALUE ...]"
    echo "  --images_per_class N  a smaller sample (N training and N held-out images per class; default 300 and 50),"
    echo "                        for slow machines: '--images_per_class 10 --epoch_size 1' is the emulated arm64 check"
    echo "  --KEY VALUE           config overrides for the demo's training, e.g. --epoch_size 1"
    exit 0
fi
PER_CLASS="" OVERRIDES=()
while (($#)); do
    if [[ $1 == --images_per_class ]]; then
        PER_CLASS=${2:-}
        [[ $PER_CLASS =~ ^[1-9][0-9]*$ ]] || { echo "error: --images_per_class takes a positive count, got '$PER_CLASS'" >&2; exit 2; }
        shift 2
    else
        OVERRIDES+=("$1"); shift
    fi
done
bash "$ROOT/scripts/setup_env.sh" "$ROOT/requirements.txt"
source "$ROOT/scripts/common.sh"
DATA="$ROOT/data/sample${PER_CLASS:+-$PER_CLASS}"
CONFIG="$ROOT/config/sample_resnet18.yaml"
OUTPUT="$ROOT/output/demo/$(date +%Y%m%d_%H%M%S)"   # a new run folder each time: nothing is overwritten
if [[ ! -f "$DATA/cifar10/test_batch.bin" ]]; then
    "$PY" -m src.data.sample_data "$DATA" ${PER_CLASS:+--train_per_class "$PER_CLASS" --test_per_class "$PER_CLASS" --formats cifar10}
fi
bash "$ROOT/scripts/run_standalone_train.sh" "$DATA/cifar10" "$CONFIG" --output_dir "$OUTPUT" ${OVERRIDES[@]+"${OVERRIDES[@]}"}
CKPT=$(ls -t "$OUTPUT"/resnet18/cifar10/resnet18-*.ckpt | head -n 1)   # the last epoch
EVAL_OUTPUT="$OUTPUT/eval_output.txt"
bash "$ROOT/scripts/run_eval.sh" "$DATA/cifar10" "$CKPT" "$CONFIG" | tee "$EVAL_OUTPUT"
RESULT=$(tail -n 1 "$EVAL_OUTPUT")
"$PY" - "$RESULT" <<'PYTHON'
import json, sys
r = json.loads(sys.argv[1])
print(f"demo: top-1 {r['top_1_accuracy']:.4f}  top-5 {r['top_5_accuracy']:.4f}  on {r['samples']} held-out images  ({r['checkpoint']})")
PYTHON
