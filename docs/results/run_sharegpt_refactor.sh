#!/usr/bin/env bash
# ShareGPT 200 served before and after the issue-15 refactor, interleaved (before, after,
# before, after), each on a freshly started server, same client (this checkout's
# `kvloom bench serve`), bf16, the default model, invariant GEMM.
# Usage: run_sharegpt_refactor.sh BEFORE_CHECKOUT AFTER_CHECKOUT
set -euo pipefail
cd "$(dirname "$0")/../.."
R=docs/results
PY=$PWD/.venv/bin/python
for load in inf c16; do
  for build in before after; do
    checkout=$1; [ "$build" = after ] && checkout=$2
    (cd "$checkout" && PYTHONPATH=$checkout exec "$PY" -m kvloom serve --port 8200 --dtype bfloat16 \
      --max-model-len 2048 --kv-cache-memory 4 --max-num-seqs 256) > /tmp/kvloom-server-$build.log 2>&1 &
    S=$!
    for i in $(seq 1 120); do sleep 1; curl -sf localhost:8200/health > /dev/null && break; done
    extra=(); [ "$load" = c16 ] && extra=(--max-concurrency 16)
    "$PY" -m kvloom bench serve --base-url http://127.0.0.1:8200 --model smollm2-135m-instruct \
      --no-progress --num-warmups 2 --ignore-eos --dataset sharegpt --num-prompts 200 "${extra[@]}" \
      --label "kvloom $build $load" --output-json $R/refactor_${build}_sharegpt200_$load.json \
      > $R/refactor_${build}_sharegpt200_$load.txt
    kill -TERM $S; wait $S || true
  done
done
echo SHAREGPT-REFACTOR-DONE
