#!/usr/bin/env bash
# Server benchmarks for docs/benchmarks.md (kvloom server + kvloom bench serve client).
set -x
cd /work/main
K=".venv/bin/python -m kvloom"
R=docs/results
MODEL=/work/smollm2-hf
PORT=8300
BASE=http://127.0.0.1:$PORT
start_server() {
  $K serve $MODEL --served-model-name smollm2-135m-instruct --port $PORT --dtype bfloat16 \
     --max-model-len 2048 --kv-cache-memory 4 --max-num-seqs 128 "$@" > /work/srv.log 2>&1 &
  SRV=$!
  for i in $(seq 1 120); do sleep 1; curl -sf $BASE/health > /dev/null && return 0; done
  return 1
}
stop_server() { kill -TERM $SRV; wait $SRV; }
B="$K bench serve --base-url $BASE --model smollm2-135m-instruct --no-progress --num-warmups 2 --ignore-eos"

# Prefix reuse at 0 / 50 / 100 %, cache on and off: 4 groups x 16 prompts of 1024 tokens, 64 out.
for cache in on off; do
  if [ $cache = on ]; then start_server; else start_server --no-prefix-cache; fi
  $B --dataset prefix --num-prompts 64 --prefix-groups 4 --prefix-len 512 --question-len 512 --reuse-ratio 0.0 --prefix-output-len 64 --label "cache-$cache reuse-0" --output-json $R/prefix_${cache}_0.json > $R/prefix_${cache}_0.txt
  $B --dataset prefix --num-prompts 64 --prefix-groups 4 --prefix-len 512 --question-len 512 --reuse-ratio 0.5 --prefix-output-len 64 --label "cache-$cache reuse-50" --output-json $R/prefix_${cache}_50.json > $R/prefix_${cache}_50.txt
  $B --dataset prefix --num-prompts 64 --prefix-groups 4 --prefix-len 1024 --question-len 0 --reuse-ratio 1.0 --prefix-output-len 64 --label "cache-$cache reuse-100" --output-json $R/prefix_${cache}_100.json > $R/prefix_${cache}_100.txt
  $B --dataset multiturn --num-prompts 16 --turns 3 --max-context-len 2048 --max-output-len 64 --label "cache-$cache multiturn" --output-json $R/multiturn_${cache}.json > $R/multiturn_${cache}.txt
  stop_server
done

# Chunked prefill vs not: long prompts keep arriving while others decode.
for mode in chunked unchunked; do
  if [ $mode = chunked ]; then start_server --max-num-batched-tokens 256 --no-prefix-cache; else start_server --no-chunked-prefill --no-prefix-cache; fi
  $B --dataset random --num-prompts 48 --random-input-len 1500 --random-output-len 96 --request-rate 1.5 --label "$mode" --output-json $R/chunked_$mode.json > $R/chunked_$mode.txt
  stop_server
done
echo ALL-SERVE-DONE
