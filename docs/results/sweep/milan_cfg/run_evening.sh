#!/usr/bin/env bash
# Milan, the evening (issue 17): after the GEMM prefetch and the attention's line feed,
# kvloom and vLLM-CPU fp32 again at 16 and 256 in flight and on the shared prefix, one
# engine at a time, fresh server per cell, alternating engines.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
K=".venv/bin/python -m kvloom"
C=docs/results/sweep/milan_cfg
$K bench sweep $C/evening_kvloom.json
$K bench sweep $C/evening_vllm_fp32.json
$K bench sweep $C/prefix_kvloom.json --output-dir docs/results/sweep/milan_evening_prefix
$K bench sweep $C/prefix_vllm_fp32.json --output-dir docs/results/sweep/milan_evening_prefix
