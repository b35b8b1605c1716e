#!/usr/bin/env bash
# ShareGPT 200 served by kvloom with the invariant GEMM and with oneDNN, all at once and
# at concurrency 16, each on a freshly started server (no earlier run in its prefix
# cache), same client (kvloom bench serve), bf16, the default model.
set -euo pipefail
cd "$(dirname "$0")/../.."
R=docs/results
for matmul in invariant onednn; do
  for load in inf c16; do
    .venv/bin/python -m kvloom serve --port 8200 --dtype bfloat16 --max-model-len 2048 --kv-cache-memory 4 \
      --max-num-seqs 256 --matmul "$matmul" > /tmp/kvloom-server-$matmul.log 2>&1 &
    S=$!
    for i in $(seq 1 120); do sleep 1; curl -sf localhost:8200/health > /dev/null && break; done
    extra=(); [ "$load" = c16 ] && extra=(--max-concurrency 16)
    .venv/bin/python -m kvloom bench serve --base-url http://127.0.0.1:8200 --model smollm2-135m-instruct \
      --no-progress --num-warmups 2 --ignore-eos --dataset sharegpt --num-prompts 200 "${extra[@]}" \
      --label "kvloom $matmul $load" --output-json $R/matmul_${matmul}_sharegpt200_$load.json \
      > $R/matmul_${matmul}_sharegpt200_$load.txt
    kill -TERM $S; wait $S || true
  done
done
echo SHAREGPT-MATMUL-DONE
