#!/usr/bin/env bash
# Issue 21: the workloads of examples/lang_programs.py on the default model
# (SmolLM2-135M-Instruct), on a quiet machine, one run after the other:
#   1. the programs in-process (kl.Local), radix cache on, then off;
#   2. against a fresh `kvloom serve` per run, cache on, then off: the programs
#      (kl.Endpoint), then the same logic as independent OpenAI calls
#      (examples/openai_calls.py). A fresh server each time, so no run finds the
#      previous one's prompts in the cache.
set -euo pipefail
OUT=docs/results/issue21
P=${PASS:+_$PASS}  # PASS=2: a second pass beside the first
PORT=${PORT:-8321}
URL=http://127.0.0.1:$PORT
PY=.venv/bin/python

.venv/bin/python examples/lang_programs.py > "$OUT/cache_on$P.jsonl"
.venv/bin/python examples/lang_programs.py --no-prefix-cache > "$OUT/cache_off$P.jsonl"

serve() {  # serve <log> [flags...]: start a server, wait for /health
    local log=$1; shift
    .venv/bin/kvloom serve --port "$PORT" "$@" > "$log" 2>&1 &
    SERVER=$!
    for _ in $(seq 300); do
        curl -sf "$URL/health" > /dev/null && return 0
        kill -0 "$SERVER" 2> /dev/null || { cat "$log"; exit 1; }
        sleep 1
    done
    echo "the server did not start"; exit 1
}
stop() { kill "$SERVER"; wait "$SERVER" || true; }

: > "$OUT/server$P.jsonl"
for cache in on off; do
    flags=(); [ "$cache" = off ] && flags=(--no-prefix-cache)
    for style in program openai; do
        serve "/tmp/kvloom-issue21-$cache-$style.log" "${flags[@]}"
        if [ "$style" = program ]; then
            $PY examples/lang_programs.py --endpoint "$URL"
        else
            $PY examples/openai_calls.py --endpoint "$URL"
        fi | $PY -c "import json,sys
for line in sys.stdin: print(json.dumps({**json.loads(line), 'prefix_cache': '$cache' == 'on'}))" \
            >> "$OUT/server$P.jsonl"
        stop
    done
done
cat "$OUT"/cache_on$P.jsonl "$OUT"/cache_off$P.jsonl "$OUT"/server$P.jsonl
