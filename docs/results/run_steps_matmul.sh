#!/usr/bin/env bash
# Decode and prefill step times, kvloom's invariant GEMM vs oneDNN (prepacked), two
# alternating passes each (the machine is noisy). Records the CPU first.
set -euo pipefail
cd "$(dirname "$0")"
KVLOOM=${KVLOOM:-../../.venv/bin/kvloom}
lscpu | grep -E "Model name|Flags" | sed 's/^Flags: */Flags: /' | cut -c1-400 > steps_cpu.txt
for pass in 1 2; do
  for matmul in invariant onednn; do
    echo "== matmul=$matmul pass $pass"
    $KVLOOM bench steps --dtype bfloat16 --matmul "$matmul" --batches 1,16,64,200 --context 300 \
      --decode-steps 20 --prefill 8x256 --repeats 5 --output-json "steps_${matmul}_${pass}.json"
  done
done
