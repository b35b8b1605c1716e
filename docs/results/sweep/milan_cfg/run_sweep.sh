#!/usr/bin/env bash
# The Milan sweeps (issue 17): kvloom and vLLM-CPU fp32, one engine at a time, a fresh
# server per cell, then the shared-prefix cell for both.
#   run_sweep.sh            the afternoon's: 1/4/16/64/256 in flight, and the plots
#   run_sweep.sh evening    after the GEMM prefetch and the line-fed attention: 16 and 256
set -euo pipefail
cd "$(dirname "$0")/../../../.."
K=".venv/bin/python -m kvloom"
C=docs/results/sweep/milan_cfg
case "${1:-afternoon}" in
  afternoon) cells=sweep prefix_out=milan_prefix_sweep ;;
  evening) cells=evening prefix_out=milan_evening_prefix ;;
  *) echo "usage: $0 [afternoon|evening]" >&2; exit 2 ;;
esac
$K bench sweep $C/${cells}_kvloom.json
$K bench sweep $C/${cells}_vllm_fp32.json
$K bench sweep $C/prefix_kvloom.json --output-dir docs/results/sweep/$prefix_out
$K bench sweep $C/prefix_vllm_fp32.json --output-dir docs/results/sweep/$prefix_out
if [ "${1:-afternoon}" = afternoon ]; then
  $K bench plot docs/results/sweep/milan_sweep/*_c*.json --out docs/plots/sweep_milan
fi
