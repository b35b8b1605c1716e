#!/usr/bin/env bash
# Benchmarks for docs/benchmarks.md, run one after another on a quiet machine.
set -x
cd /work/main
K=".venv/bin/python -m kvloom"
R=docs/results
MODEL=/work/smollm2-hf
$K bench offline $MODEL --dtype bfloat16 --num-prompts 100 --output-len 256 --max-model-len 2048 --max-num-seqs 64 --compare --output-json $R/offline_continuous_vs_static.json > $R/offline_continuous_vs_static.txt 2>/dev/null
for p in fcfs fcfs-cheapest-victim watermark; do
  $K bench offline $MODEL --dtype bfloat16 --num-prompts 60 --output-len 256 --max-model-len 2048 --max-num-seqs 64 --num-blocks 300 --policy $p --high-watermark 0.9 --low-watermark 0.5 --no-prefix-cache --output-json $R/offline_pressure_$p.json > $R/offline_pressure_$p.txt 2>/dev/null
done
$K bench offline $MODEL --dtype bfloat16 --num-prompts 24 --output-len 128 --max-model-len 2048 --max-num-seqs 16 --num-blocks 150 --no-prefix-cache --trace-file $R/pressure_trace.json > /dev/null 2>&1
$K trace render $R/pressure_trace.json --png docs/pressure_timeline.png --max-requests 24 > $R/pressure_trace.txt 2>&1
$K bench structured $MODEL --num-prompts 16 --dtype bfloat16 > $R/structured.txt 2>&1
echo ALL-OFFLINE-DONE
