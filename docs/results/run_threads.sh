#!/usr/bin/env bash
# Compute threads vs the HTTP/scheduling work on 2 cores: the same server with
# --num-threads 1 (one core left to the event loop and the client) and 2 (the default:
# torch's pool on both cores, the event loop runs while kernels release the GIL).
set -x
cd /work/main
R=docs/results
for threads in 1 2; do
  .venv/bin/python -m kvloom serve /work/smollm2-hf --served-model-name smollm2-135m-instruct --port 8200 --dtype bfloat16 --max-model-len 2048 --kv-cache-memory 4 --max-num-seqs 256 --num-threads $threads > /work/kvloom-threads.log 2>&1 &
  S=$!
  for i in $(seq 1 100); do sleep 1; curl -sf localhost:8200/health > /dev/null && break; done
  .venv/bin/python -m kvloom bench serve --base-url http://127.0.0.1:8200 --model smollm2-135m-instruct --no-progress --num-warmups 2 --ignore-eos --dataset sharegpt --num-prompts 64 --max-concurrency 16 --label "threads=$threads" --output-json $R/kvloom_threads$threads.json > $R/kvloom_threads$threads.txt
  kill -TERM $S; wait $S
done
