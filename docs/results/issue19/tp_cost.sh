#!/usr/bin/env bash
# What tensor parallel costs on one 2-core machine: engine step times and each step's
# collectives, one process vs 2 ranks (shared memory: native stack and modules; gloo: modules), on a random model of
# SmolLM2-135M's shape with 8/4 heads (make_tp_model.py; the real 9/3 do not split in 2).
# Usage: docs/results/issue19/tp_cost.sh [MODEL_DIR]   (results: docs/results/issue19/steps_*.json)
set -euo pipefail
cd "$(dirname "$0")/../../.."
MODEL=${1:-/tmp/kvloom-tp-model}
[ -d "$MODEL" ] || .venv/bin/python docs/results/issue19/make_tp_model.py "$MODEL"
OUT=docs/results/issue19
run() {  # name, flags...
  local name=$1; shift
  echo "== $name"
  .venv/bin/kvloom bench steps "$MODEL" --batches 1,16,64 --context 300 --decode-steps 20 --prefill 1x512 \
      --repeats 5 --output-json "$OUT/steps_$name.json" "$@" 2>&1 | grep -v -E "^W|INFO"
}
run tp1_native
run tp1_modules --decoder-stack modules
run tp2_shm --tensor-parallel-size 2
run tp2_shm_modules --tensor-parallel-size 2 --decoder-stack modules
run tp2_gloo --tensor-parallel-size 2 --no-shared-memory
