#!/usr/bin/env bash
# The router's measurement (issue 19): a multi-tenant workload (8 system prompts of
# 1,000 tokens, 200 users, 32-token questions, 32 output tokens, 16 in flight) against
#   single       one `kvloom serve` with every core
#   cache_aware  two `kvloom serve` (half the cores each) behind `kvloom router --policy cache_aware`
#   round_robin  the same two, fresh, behind `kvloom router --policy round_robin`
# Each configuration gets fresh workers (cold caches). Prints, per configuration:
# throughput, mean/p50 TTFT, and each worker's prefix-cache hit rate from its own /metrics.
#
#   docs/results/router/run.sh                       # the full measurement, default model
#   SMOKE=1 docs/results/router/run.sh               # a short run that proves the script works
#
# Knobs (environment): MODEL (default: kvloom's default model), PREFIXES, PREFIX_LEN, USERS,
# QUESTION_LEN, OUTPUT_LEN, CONCURRENCY, CONFIGS ("single cache_aware round_robin"),
# EXTRA_SERVE_FLAGS (e.g. "--num-blocks 800" to make the KV pool the constraint),
# OUT (results directory), BASE_PORT.
set -euo pipefail
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-}
if [[ -n "${SMOKE:-}" ]]; then
  PREFIXES=${PREFIXES:-2}; PREFIX_LEN=${PREFIX_LEN:-200}; USERS=${USERS:-16}
  QUESTION_LEN=${QUESTION_LEN:-32}; OUTPUT_LEN=${OUTPUT_LEN:-8}; CONCURRENCY=${CONCURRENCY:-4}
fi
PREFIXES=${PREFIXES:-8}; PREFIX_LEN=${PREFIX_LEN:-1000}; USERS=${USERS:-200}
QUESTION_LEN=${QUESTION_LEN:-32}; OUTPUT_LEN=${OUTPUT_LEN:-32}; CONCURRENCY=${CONCURRENCY:-16}
CONFIGS=${CONFIGS:-single cache_aware round_robin}
EXTRA_SERVE_FLAGS=${EXTRA_SERVE_FLAGS:-}
# Tenants' users interleaved (a seeded shuffle), not group after group.
BENCH_FLAGS=${BENCH_FLAGS:---prefix-interleave}
OUT=${OUT:-docs/results/router/out}
BASE_PORT=${BASE_PORT:-18300}
CORES=$(nproc)
HALF=$(( CORES / 2 > 0 ? CORES / 2 : 1 ))
mkdir -p "$OUT"

PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  PIDS=()
}
trap cleanup EXIT

wait_health() {  # URL: poll /health (model loads take a while), fail after 600 s
  for _ in $(seq 1 3000); do
    if curl -sf "$1/health" >/dev/null; then return 0; fi
    sleep 0.2
  done
  echo "error: $1 never became healthy" >&2; exit 1
}

start_worker() {  # PORT THREADS
  # shellcheck disable=SC2086
  $PY -m kvloom serve $MODEL --port "$1" --num-threads "$2" --disable-log-stats --log-level warning \
    $EXTRA_SERVE_FLAGS >"$OUT/worker-$1.log" 2>&1 &
  PIDS+=($!)
}

start_router() {  # PORT POLICY WORKER_URL...
  local port=$1 policy=$2; shift 2
  local flags=(); for url in "$@"; do flags+=(--worker "$url"); done
  $PY -m kvloom router "${flags[@]}" --port "$port" --policy "$policy" --log-level warning \
    >"$OUT/router-$policy.log" 2>&1 &
  PIDS+=($!)
}

bench() {  # LABEL URL
  $PY -m kvloom bench serve --base-url "$2" --dataset prefix --prefix-groups "$PREFIXES" \
    --prefix-len "$PREFIX_LEN" --question-len "$QUESTION_LEN" --prefix-output-len "$OUTPUT_LEN" \
    --num-prompts "$USERS" --max-concurrency "$CONCURRENCY" --ignore-eos --label "$1" --no-progress \
    $BENCH_FLAGS --output-json "$OUT/$1.json" >"$OUT/$1.txt"
}

hit_rates() {  # LABEL WORKER_URL...: each worker's prefix-cache hits / queries since it started
  local label=$1; shift
  for url in "$@"; do
    curl -sf "$url/metrics" | $PY -c '
import sys
from prometheus_client.parser import text_string_to_metric_families
values = {s.name: s.value for f in text_string_to_metric_families(sys.stdin.read()) for s in f.samples}
hits, queries = values.get("kvloom:prefix_cache_hits_total", 0.0), values.get("kvloom:prefix_cache_queries_total", 0.0)
print(f"{sys.argv[1]}\t{sys.argv[2]}\t{hits / queries if queries else 0.0:.4f}\t{int(hits)}\t{int(queries)}")
' "$label" "$url"
  done >>"$OUT/hit_rates.tsv"
}

: >"$OUT/hit_rates.tsv"
for config in $CONFIGS; do
  echo "== $config" >&2
  if [[ $config == single ]]; then
    start_worker "$BASE_PORT" "$CORES"
    workers=("http://127.0.0.1:$BASE_PORT"); target=${workers[0]}
    wait_health "$target"
  else
    start_worker $((BASE_PORT + 1)) "$HALF"
    start_worker $((BASE_PORT + 2)) "$HALF"
    workers=("http://127.0.0.1:$((BASE_PORT + 1))" "http://127.0.0.1:$((BASE_PORT + 2))")
    for url in "${workers[@]}"; do wait_health "$url"; done
    start_router "$BASE_PORT" "$config" "${workers[@]}"
    target="http://127.0.0.1:$BASE_PORT"
    wait_health "$target"
  fi
  bench "$config" "$target"
  hit_rates "$config" "${workers[@]}"
  cleanup
done

$PY - "$OUT" $CONFIGS <<'EOF'
import csv, json, sys
out, configs = sys.argv[1], sys.argv[2:]
rates, totals = {}, {}
for label, url, rate, hits, queries in csv.reader(open(f"{out}/hit_rates.tsv"), delimiter="\t"):
    rates.setdefault(label, []).append((url.rsplit(":", 1)[1], float(rate)))
    done, asked = totals.get(label, (0, 0))
    totals[label] = (done + int(hits), asked + int(queries))
print(f"{'config':12} {'ok':>4} {'fail':>4} {'req/s':>7} {'out tok/s':>9} {'TTFT mean ms':>12} "
      f"{'TTFT p50 ms':>11} {'hit rate':>8}  per worker (port: rate)")
for label in configs:
    m = json.load(open(f"{out}/{label}.json"))["metrics"]
    workers = ", ".join(f"{port}: {rate:.3f}" for port, rate in rates.get(label, []))
    hits, queries = totals.get(label, (0, 0))
    print(f"{label:12} {m['completed']:>4} {m['failed']:>4} {m['request_throughput']:>7.2f} "
          f"{m['output_throughput']:>9.1f} {m['ttft_ms']['mean']:>12.1f} {m['ttft_ms']['median']:>11.1f} "
          f"{hits / max(1, queries):>8.3f}  {workers}")
EOF
