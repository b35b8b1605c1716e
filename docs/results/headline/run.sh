#!/usr/bin/env bash
# The seed's headline claims (MISSION.md section 7) measured on the current engine, one run
# after another on a quiet machine: continuous vs static batching and KV use, preemption per
# policy, prefix reuse at 0 / 50 / 100 %, multi-turn chat with either history, chunked
# prefill. docs/benchmarks.md's sections of those names quote what this wrote.
#     MODEL=~/kvloom-peers/models/smollm2-135m-instruct bash docs/results/headline/run.sh
# MODEL: the default model as a Hugging Face directory (shared/peers/setup.sh makes it).
set -u
cd "$(dirname "$0")/../../.."
K=".venv/bin/python -m kvloom"
R=${R:-docs/results/headline}
MODEL=${MODEL:-$HOME/kvloom-peers/models/smollm2-135m-instruct}
PORT=8300
BASE=http://127.0.0.1:$PORT
lscpu | grep -E "Model name|^CPU family|^Model:" > "$R/cpu.txt"

start_server() {
  $K serve "$MODEL" --served-model-name smollm2-135m-instruct --port $PORT --dtype bfloat16 \
     --max-model-len 2048 --kv-cache-memory 4 --max-num-seqs 128 "$@" > "$R/server.log" 2>&1 &
  SRV=$!
  for _ in $(seq 1 120); do sleep 1; curl -sf $BASE/health > /dev/null && return 0; done
  return 1
}
stop_server() { kill -TERM "$SRV"; wait "$SRV"; }
B="$K bench serve --base-url $BASE --model smollm2-135m-instruct --no-progress --num-warmups 2 --ignore-eos"

# Prefix reuse: 4 groups x 16 prompts of 1024 tokens, 64 out; one server per cache mode.
for cache in on off; do
  if [ $cache = on ]; then start_server; else start_server --no-prefix-cache; fi
  for reuse in 0 50 100; do
    case $reuse in
      0) shape="--prefix-len 512 --question-len 512 --reuse-ratio 0.0";;
      50) shape="--prefix-len 512 --question-len 512 --reuse-ratio 0.5";;
      100) shape="--prefix-len 1024 --question-len 0 --reuse-ratio 1.0";;
    esac
    # shellcheck disable=SC2086
    $B --dataset prefix --num-prompts 64 --prefix-groups 4 $shape --prefix-output-len 64 \
       --label "cache-$cache reuse-$reuse" --output-json "$R/prefix_${cache}_$reuse.json" > "$R/prefix_${cache}_$reuse.txt"
  done
  stop_server
done

# Multi-turn chat: 16 conversations x 3 turns; a fresh server for every run.
for history in generated dataset; do
  for cache in on off; do
    for in_flight in 1 2 16; do
      if [ $cache = on ]; then start_server; else start_server --no-prefix-cache; fi
      $B --dataset multiturn --num-prompts 16 --turns 3 --max-context-len 2048 --max-output-len 64 \
         --max-concurrency $in_flight --history $history --label "cache-$cache multiturn c$in_flight $history" \
         --output-json "$R/mt_${history}_${cache}_c$in_flight.json" > "$R/mt_${history}_${cache}_c$in_flight.txt"
      stop_server
    done
  done
done

# Continuous vs static batching (KV use), then preemption under a 300-block pool per policy.
$K bench offline "$MODEL" --dtype bfloat16 --num-prompts 100 --output-len 256 --max-model-len 2048 \
   --max-num-seqs 64 --compare --output-json "$R/offline_continuous_vs_static.json" > "$R/offline_continuous_vs_static.txt" 2>/dev/null
# ... with a pool where max-length reservation holds 5 requests (700 blocks of 16 tokens):
$K bench offline "$MODEL" --dtype bfloat16 --num-prompts 100 --output-len 256 --max-model-len 2048 --max-num-seqs 64 \
   --num-blocks 700 --compare --output-json "$R/offline_continuous_vs_static_700blocks.json" \
   > "$R/offline_continuous_vs_static_700blocks.txt" 2>/dev/null
for policy in fcfs fcfs-cheapest-victim watermark; do
  $K bench offline "$MODEL" --dtype bfloat16 --num-prompts 60 --output-len 256 --max-model-len 2048 --max-num-seqs 64 \
     --num-blocks 300 --policy $policy --high-watermark 0.9 --low-watermark 0.5 --no-prefix-cache \
     --output-json "$R/offline_pressure_$policy.json" > "$R/offline_pressure_$policy.txt" 2>/dev/null
done

# Chunked prefill: 1500-token prompts arriving at 1.5 req/s while earlier ones decode.
for mode in chunked unchunked; do
  if [ $mode = chunked ]; then start_server --max-num-batched-tokens 256 --no-prefix-cache
  else start_server --no-chunked-prefill --no-prefix-cache; fi
  $B --dataset random --num-prompts 48 --random-input-len 1500 --random-output-len 96 --request-rate 1.5 \
     --label "$mode" --output-json "$R/chunked_$mode.json" > "$R/chunked_$mode.txt"
  stop_server
done
echo done
