#!/usr/bin/env bash
# kvloom LLM engine vs OpenVINO GenAI offline, on the same token ids (shared/peers:
# openvino_install.sh, openvino_export.sh, make_ov_workload.py first). Alternating runs,
# one engine at a time; all requests submitted at once, greedy, ignore_eos; the shared
# prefix set sends its first request ahead so that both caches can hit.
set -euo pipefail
PEERS=${PEERS:-$HOME/kvloom-peers}
OUT=${OUT:-docs/results/openvino}
RUNS=${RUNS:-3}
# OpenVINO's options beyond the defaults (bf16); on AVX2-only CPUs its paged attention takes only an
# f32 cache: OV_ARGS="--kv-precision f32 --inference-precision f32"
OV_ARGS=${OV_ARGS:-}
KVLOOM=${KVLOOM:-.venv/bin/python -m kvloom}
mkdir -p "$OUT"
lscpu | grep -E "Model name|Flags" | sed 's/Flags:.*\(amx_tile\).*/AMX: yes/; s/Flags:.*/AMX: no/' > "$OUT/cpu.txt"
model=$PEERS/models/smollm2-135m-instruct
for run in $(seq 1 "$RUNS"); do
  "$PEERS/ov-venv/bin/python" /work/shared/peers/openvino_bench.py $OV_ARGS --workload "$PEERS/workloads/sharegpt200.jsonl" \
      --out "$OUT/ov_sharegpt200_$run.json" > "$OUT/ov_sharegpt200_$run.txt" 2>&1
  $KVLOOM bench offline "$model" --dtype bfloat16 --kv-cache-memory 4 --max-num-seqs 256 --dataset tokens \
      --dataset-path "$PEERS/workloads/sharegpt200.jsonl" --num-prompts 200 \
      --output-json "$OUT/kvloom_sharegpt200_$run.json" > "$OUT/kvloom_sharegpt200_$run.txt" 2>&1
done
for run in $(seq 1 "$RUNS"); do
  "$PEERS/ov-venv/bin/python" /work/shared/peers/openvino_bench.py $OV_ARGS --workload "$PEERS/workloads/prefix100.jsonl" \
      --prefix-caching --submit stagger --out "$OUT/ov_prefix100_$run.json" > "$OUT/ov_prefix100_$run.txt" 2>&1
  $KVLOOM bench offline "$model" --dtype bfloat16 --kv-cache-memory 4 --max-num-seqs 256 --dataset tokens \
      --dataset-path "$PEERS/workloads/prefix100.jsonl" --num-prompts 100 --lead 1 \
      --output-json "$OUT/kvloom_prefix100_$run.json" > "$OUT/kvloom_prefix100_$run.txt" 2>&1
done
