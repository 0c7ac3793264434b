#!/usr/bin/env bash
# The demo: set up .venv, write the sample dataset, train ResNet18 on it, evaluate, print top-1/top-5.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    echo "usage: bash scripts/run_demo.sh [--KEY VALUE ...]   (config overrides for the demo's training, e.g. --epoch_size 1)"
    exit 0
fi
bash "$ROOT/scripts/setup_env.sh" "$ROOT/requirements.txt"
source "$ROOT/scripts/common.sh"
DATA="$ROOT/data/sample"
CONFIG="$ROOT/config/sample_resnet18.yaml"
OUTPUT="$ROOT/output/demo/$(date +%Y%m%d_%H%M%S)"   # a new run folder each time: nothing is overwritten
if [[ ! -f "$DATA/cifar10/test_batch.bin" ]]; then
    "$PY" -m src.data.sample_data "$DATA"
fi
bash "$ROOT/scripts/run_standalone_train.sh" "$DATA/cifar10" "$CONFIG" --output_dir "$OUTPUT" "$@"
CKPT=$(ls -t "$OUTPUT"/resnet18/cifar10/resnet18-*.ckpt | head -n 1)   # the last epoch
EVAL_OUTPUT="$OUTPUT/eval_output.txt"
bash "$ROOT/scripts/run_eval.sh" "$DATA/cifar10" "$CKPT" "$CONFIG" | tee "$EVAL_OUTPUT"
RESULT=$(tail -n 1 "$EVAL_OUTPUT")
"$PY" - "$RESULT" <<'PYTHON'
import json, sys
r = json.loads(sys.argv[1])
print(f"demo: top-1 {r['top_1_accuracy']:.4f}  top-5 {r['top_5_accuracy']:.4f}  on {r['samples']} held-out images  ({r['checkpoint']})")
PYTHON
