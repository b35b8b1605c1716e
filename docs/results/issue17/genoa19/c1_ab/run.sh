#!/usr/bin/env bash
# The eighteenth session's open question, measured again: multi-turn chat at one request in
# flight (the headline's command, generated history, cache on), the eighteenth session's
# last commit against 60aeaea, each from a worktree of its own (run from its directory so
# that it imports its own kvloom, and untouched by edits here), alternating, a fresh
# server per run:
#   git worktree add /tmp/wt60 60aeaea; git worktree add /tmp/wthead 3e54829
#   bash docs/results/issue17/genoa19/c1_ab/run.sh
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
MAIN=$(cd "$HERE/../../../../.." && pwd)
PY=$MAIN/.venv/bin/python
MODEL=${MODEL:-$HOME/kvloom-peers/models/smollm2-135m-instruct}
PORT=8301
BASE=http://127.0.0.1:$PORT
ROUNDS=${ROUNDS:-6}
run() {  # $1 label, $2 checkout
  (cd "$2" && exec "$PY" -m kvloom serve "$MODEL" --served-model-name smollm2-135m-instruct --port $PORT \
     --dtype bfloat16 --max-model-len 2048 --kv-cache-memory 4 --max-num-seqs 128) > "$HERE/server_$1.log" 2>&1 &
  local srv=$!
  for _ in $(seq 1 120); do sleep 1; curl -sf $BASE/health > /dev/null && break; done
  (cd "$MAIN" && "$PY" -m kvloom bench serve --base-url $BASE --model smollm2-135m-instruct --no-progress \
     --num-warmups 2 --ignore-eos --dataset multiturn --num-prompts 16 --turns 3 --max-context-len 2048 \
     --max-output-len 64 --max-concurrency 1 --history generated --label "$1 c1" \
     --output-json "$HERE/$1_$3.json") > "$HERE/$1_$3.txt"
  kill -TERM $srv; wait $srv
  echo "$(date +%H:%M:%S) $1 round $3 $(grep 'Mean TPOT' "$HERE/$1_$3.txt")"
}
for r in $(seq 1 "$ROUNDS"); do
  if (( r % 2 )); then run before /tmp/wt60 "$r"; run head /tmp/wthead "$r"
  else run head /tmp/wthead "$r"; run before /tmp/wt60 "$r"; fi
done
