#!/usr/bin/env bash
# The Milan sweep (issue 17): kvloom and vLLM-CPU fp32 at 1/4/16/64/256 in flight, then
# the shared-prefix cell for both, one engine at a time, fresh server per cell.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
K=".venv/bin/python -m kvloom"
C=docs/results/sweep/milan_cfg
$K bench sweep $C/sweep_kvloom.json
$K bench sweep $C/sweep_vllm_fp32.json
$K bench sweep $C/prefix_kvloom.json --output-dir docs/results/sweep/milan_prefix_sweep
$K bench sweep $C/prefix_vllm_fp32.json --output-dir docs/results/sweep/milan_prefix_sweep
$K bench plot docs/results/sweep/milan_sweep/*_c*.json --out docs/plots/sweep_milan
