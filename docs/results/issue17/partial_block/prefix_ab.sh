#!/usr/bin/env bash
# Alternating: OpenVINO, kvloom before (HEAD worktree /tmp/old), kvloom after (/work/main); prefix100.
set -uo pipefail
PEERS=$HOME/kvloom-peers
OUT=${OUT:-/work/main/docs/results/issue17/partial_block}
RUNS=${RUNS:-3}
mkdir -p "$OUT"
lscpu | grep -E "Model name|^Model:" > "$OUT/cpu.txt"
model=$PEERS/models/smollm2-135m-instruct
for run in $(seq 1 "$RUNS"); do
  "$PEERS/ov-venv/bin/python" /work/shared/peers/openvino_bench.py --kv-precision f32 --inference-precision f32 \
      --workload "$PEERS/workloads/prefix100.jsonl" --prefix-caching --submit stagger \
      --out "$OUT/ov_prefix100_$run.json" > "$OUT/ov_prefix100_$run.txt" 2>&1
  for side in before after; do
    dir=/work/main; [ "$side" = before ] && dir=/tmp/old
    (cd "$dir" && /work/main/.venv/bin/python -m kvloom bench offline "$model" --dtype bfloat16 --kv-cache-memory 4 \
        --max-num-seqs 256 --dataset tokens --dataset-path "$PEERS/workloads/prefix100.jsonl" --num-prompts 100 --lead 1 \
        --output-json "$OUT/kvloom_${side}_prefix100_$run.json") > "$OUT/kvloom_${side}_prefix100_$run.txt" 2>&1
  done
done
