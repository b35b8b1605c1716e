#!/usr/bin/env bash
# ShareGPT 200 at concurrency 16 on freshly started servers (no earlier run of the same
# prompts in their prefix caches), kvloom then vLLM-CPU, same client. Usage: [both|kvloom|vllm] [label suffix]
set -x
cd /work/main
R=docs/results
TAG=${2:-}
B() { .venv/bin/python -m kvloom bench serve --base-url http://127.0.0.1:$1 --model smollm2-135m-instruct --no-progress --num-warmups 2 --ignore-eos --dataset sharegpt --num-prompts 200 --max-concurrency 16 --label "$2 c16 fresh" --output-json $R/${2}_sharegpt200_c16_fresh$TAG.json > $R/${2}_sharegpt200_c16_fresh$TAG.txt; }
if [ "${1:-both}" != vllm ]; then
.venv/bin/python -m kvloom serve /work/smollm2-hf --served-model-name smollm2-135m-instruct --port 8200 --dtype bfloat16 --max-model-len 2048 --kv-cache-memory 4 --max-num-seqs 256 > /work/kvloom-server4.log 2>&1 &
S=$!
for i in $(seq 1 100); do sleep 1; curl -sf localhost:8200/health > /dev/null && break; done
B 8200 kvloom
kill -TERM $S; wait $S
fi
[ "${1:-both}" = kvloom ] && exit 0
VLLM_CPU_KVCACHE_SPACE=4 /work/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server --model /work/smollm2-hf --dtype bfloat16 --port 8100 --max-model-len 2048 --served-model-name smollm2-135m-instruct > /work/vllm-server4.log 2>&1 &
V=$!
for i in $(seq 1 200); do sleep 2; curl -sf localhost:8100/health > /dev/null && break; done
B 8100 vllm
kill -TERM $V; wait $V
echo FRESH-DONE
