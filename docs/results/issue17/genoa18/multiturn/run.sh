#!/usr/bin/env bash
# The headline's multi-turn runs with the history a chat client sends (generated), cache on,
# 1 and 16 conversations in flight, on the engine with tails (docs/results/headline/run.sh's
# commands): MODEL=~/kvloom-peers/models/smollm2-135m-instruct bash .../multiturn/run.sh
set -u
cd "$(dirname "$0")/../../../../.."
K=".venv/bin/python -m kvloom"
R=docs/results/issue17/genoa18/multiturn
MODEL=${MODEL:-$HOME/kvloom-peers/models/smollm2-135m-instruct}
PORT=8300
BASE=http://127.0.0.1:$PORT
B="$K bench serve --base-url $BASE --model smollm2-135m-instruct --no-progress --num-warmups 2 --ignore-eos"
for in_flight in 1 16; do
  $K serve "$MODEL" --served-model-name smollm2-135m-instruct --port $PORT --dtype bfloat16 \
     --max-model-len 2048 --kv-cache-memory 4 --max-num-seqs 128 > "$R/server.log" 2>&1 &
  SRV=$!
  for _ in $(seq 1 120); do sleep 1; curl -sf $BASE/health > /dev/null && break; done
  $B --dataset multiturn --num-prompts 16 --turns 3 --max-context-len 2048 --max-output-len 64 \
     --max-concurrency $in_flight --history generated --label "cache-on multiturn c$in_flight generated" \
     --output-json "$R/mt_generated_on_c$in_flight.json" > "$R/mt_generated_on_c$in_flight.txt"
  kill -TERM "$SRV"; wait "$SRV"
done
