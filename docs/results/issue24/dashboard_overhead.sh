#!/usr/bin/env bash
# Issue 24: what an open dashboard costs the engine. One `kvloom serve` (default model)
# per pass; the same ShareGPT run (200 prompts, concurrency 16, --ignore-eos) with
#   none:    no dashboard client,
#   sse:     a client reading /dashboard/events 5 times a second (what the page asks for),
#   browser: headless Chromium on /dashboard (the page itself, drawing; on these 2 cores
#            its rendering competes with the engine for the CPU),
#   off:     --disable-dashboard (no live stats and no scheduler trace at all),
#   trace:   --disable-dashboard with the 256-step scheduler trace the dashboard keeps,
# in the order given by $ORDER, for each pass in $PASSES (default two). Results:
# docs/results/issue24/<mode>_<pass>.json.
set -euo pipefail
cd "$(dirname "$0")/../../.."
py=.venv/bin/python
out=docs/results/issue24
port=8124
for pass in ${PASSES:-1 2}; do
  for mode in ${ORDER:-none sse browser off}; do
    case $mode in
      off) flags=--disable-dashboard ;;
      trace) flags="--disable-dashboard --trace --trace-capacity 256" ;;  # the dashboard's trace alone
      *) flags="" ;;
    esac
    $py -m kvloom serve --port $port $flags > /tmp/dash_serve.log 2>&1 &
    server=$!
    $py - <<PY
import time, httpx
for _ in range(240):
    try:
        if httpx.get("http://127.0.0.1:$port/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
PY
    client=""
    if [ "$mode" = sse ]; then
      $py - > /tmp/dash_sse.log 2>&1 <<PY &
import httpx
with httpx.stream("GET", "http://127.0.0.1:$port/dashboard/events?interval=0.2", timeout=None) as s:
    for n, line in enumerate(s.iter_lines()):
        pass
PY
      client=$!
    elif [ "$mode" = browser ]; then
      # The README's screenshot: the first pass's page, 45 s into the run.
      shot=$([ "$pass" = 1 ] && echo "--out docs/images/dashboard.png" || true)
      $py scripts/dashboard_screenshot.py --url http://127.0.0.1:$port/dashboard --after 45 $shot --hold 100000 \
        > /tmp/dash_browser.log 2>&1 &
      client=$!
    fi
    $py -m kvloom bench serve --base-url http://127.0.0.1:$port --dataset sharegpt --num-prompts 200 \
      --max-concurrency 16 --ignore-eos --no-progress --label "$mode" --output-json $out/${mode}_$pass.json \
      > $out/${mode}_$pass.txt 2>&1
    [ -n "$client" ] && kill $client 2>/dev/null || true
    kill $server; wait $server 2>/dev/null || true
  done
done
grep -h "output throughput\|Output token throughput\|tok/s" $out/*_[12].txt | head -40
