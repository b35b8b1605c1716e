#!/usr/bin/env bash
# kvloom LLM engine vs OpenVINO GenAI offline, on the same token ids (shared/peers:
# openvino_install.sh, openvino_export.sh, make_ov_workload.py first). Alternating runs,
# one engine at a time; all requests submitted at once, greedy, ignore_eos; the shared
# prefix set sends its first request ahead so that both caches can hit.
# NGRAM=1: both engines with n-gram speculation (prompt lookup), up to 4 drafts from
# n-grams of up to 4 tokens (OpenVINO's through issue17/genoa9/openvino_prompt_lookup.py).
# WORKLOADS: which sets to run (default both).
set -euo pipefail
PEERS=${PEERS:-$HOME/kvloom-peers}
OUT=${OUT:-docs/results/openvino}
RUNS=${RUNS:-3}
WORKLOADS=${WORKLOADS:-sharegpt200 prefix100}
# OpenVINO's options beyond the defaults (bf16); on AVX2-only CPUs its paged attention takes only an
# f32 cache: OV_ARGS="--kv-precision f32 --inference-precision f32"
OV_ARGS=${OV_ARGS:-}
KVLOOM=${KVLOOM:-.venv/bin/python -m kvloom}
OV_BENCH=/work/shared/peers/openvino_bench.py
KV_ARGS=()
if [ "${NGRAM:-0}" = 1 ]; then
  OV_BENCH=$(dirname "$0")/issue17/genoa9/openvino_prompt_lookup.py
  KV_ARGS=(--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}')
fi
mkdir -p "$OUT"
lscpu | grep -E "Model name|Flags" | sed 's/Flags:.*\(amx_tile\).*/AMX: yes/; s/Flags:.*/AMX: no/' > "$OUT/cpu.txt"
model=$PEERS/models/smollm2-135m-instruct
for workload in $WORKLOADS; do
  case $workload in
    sharegpt200) num=200; ov_submit=(); kv_lead=() ;;
    prefix100) num=100; ov_submit=(--prefix-caching --submit stagger); kv_lead=(--lead 1) ;;
    *) echo "unknown workload $workload" >&2; exit 2 ;;
  esac
  for run in $(seq 1 "$RUNS"); do
    "$PEERS/ov-venv/bin/python" "$OV_BENCH" $OV_ARGS --workload "$PEERS/workloads/$workload.jsonl" "${ov_submit[@]}" \
        --out "$OUT/ov_${workload}_$run.json" > "$OUT/ov_${workload}_$run.txt" 2>&1
    $KVLOOM bench offline "$model" --dtype bfloat16 --kv-cache-memory 4 --max-num-seqs 256 --dataset tokens \
        --dataset-path "$PEERS/workloads/$workload.jsonl" --num-prompts $num "${kv_lead[@]}" "${KV_ARGS[@]}" \
        --output-json "$OUT/kvloom_${workload}_$run.json" > "$OUT/kvloom_${workload}_$run.txt" 2>&1
  done
done
