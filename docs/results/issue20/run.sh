#!/usr/bin/env bash
# Issue 20: 1,500-token prompts (Poisson) arriving while 32 requests decode, on the
# default model (SmolLM2-135M-Instruct, bf16): one instance on both cores vs one
# prefill + one decode instance (one core each) behind the router. Then step times on
# one core and the N:M simulation from them. Run from the repository root on a quiet
# machine; writes docs/results/issue20/*.json. The client and the router share the
# machine's two cores with the engines (the machines we have have no third core).
set -euo pipefail
OUT=docs/results/issue20
K=.venv/bin/kvloom
RATE=${RATE:-0.2}
N=${N:-10}
TAG=${TAG:-}            # e.g. TAG=_run2: a second pass, written next to the first
ONLY_INTERFERENCE=${ONLY_INTERFERENCE:-}  # set: skip the step times and the simulation
COMMON=(--decodes 32 --decode-prompt-len 64 --decode-output-len 2048 --prompt-len 1500
        --prompt-output-len 16 --num-prompts "$N" --request-rate "$RATE" --seed 0 --baseline-seconds 3)
wait_up() { for _ in $(seq 240); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.5; done; return 1; }
stop() { kill "$@" 2>/dev/null || true; wait "$@" 2>/dev/null || true; }

# A: one instance, both cores.
$K serve --port 8200 --num-threads 2 --disable-log-stats > "$OUT/serve_single.log" 2>&1 &
S=$!
wait_up http://127.0.0.1:8200
$K bench interference --base-url http://127.0.0.1:8200 "${COMMON[@]}" --result-json "$OUT/interference_single$TAG.json"
stop $S

# B: one prefill + one decode instance, one core each, and the router.
taskset -c 0 $K serve --role prefill --port 8210 --num-threads 1 --disable-log-stats > "$OUT/serve_prefill.log" 2>&1 &
P=$!
taskset -c 1 $K serve --role decode --port 8211 --num-threads 1 --disable-log-stats > "$OUT/serve_decode.log" 2>&1 &
D=$!
wait_up http://127.0.0.1:8210; wait_up http://127.0.0.1:8211
$K router --prefill http://127.0.0.1:8210 --decode http://127.0.0.1:8211 --port 8220 > "$OUT/router.log" 2>&1 &
R=$!
wait_up http://127.0.0.1:8220
$K bench interference --base-url http://127.0.0.1:8220 "${COMMON[@]}" --result-json "$OUT/interference_pd$TAG.json"
stop $R $P $D

[ -n "$ONLY_INTERFERENCE" ] && exit 0

# Step times on one core, for the simulation.
taskset -c 0 $K bench steps --num-threads 1 --batches 1,8,16,32,64 --context 300 \
    --prefill 1x256,1x512,1x1024,1x1500 --output-json "$OUT/steps_1core.json"
$K bench pd-sim --steps-json "$OUT/steps_1core.json" --transfer-json "$OUT/interference_pd.json" \
    --splits 1:1,1:2,2:1,1:3,3:1 --rates 0.05,0.1,0.2,0.3,0.4,0.6,0.8,1.0 --prompt-len 1500 \
    --output-len 256 --max-batch 64 --ttft-slo 4000 --itl-slo 100 --itl-slo-stat mean \
    --plot "$OUT/pd_sim.png" --result-json "$OUT/pd_sim.json" | tee "$OUT/pd_sim.txt"
