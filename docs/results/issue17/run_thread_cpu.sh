#!/bin/bash
# CPU seconds of each thread of a kvloom server, and of the client, over one
# concurrency-16 ShareGPT run (64 prompts); run from the repository root. Extra
# arguments go to the server.
M=${MODEL:-$HOME/kvloom-peers/models/smollm2-135m-instruct}
.venv/bin/python -m kvloom serve $M --served-model-name smollm2-135m-instruct --dtype bfloat16 \
  --max-model-len 2048 --kv-cache-memory 4 --max-num-seqs 256 --port 8200 "$@" > /tmp/serve_threads.log 2>&1 &
SP=$!
until curl -sf localhost:8200/health >/dev/null; do sleep 1; done
snap() { for t in /proc/$SP/task/*; do echo "$(basename $t) $(awk '{print $14+$15}' $t/stat)"; done | sort; }
snap > /tmp/threads_before.txt
/usr/bin/time -f "client cpu %U user %S sys, wall %e" .venv/bin/python -m kvloom bench serve --base-url http://127.0.0.1:8200 \
  --model smollm2-135m-instruct --num-warmups 2 --ignore-eos --dataset sharegpt --num-prompts 64 --max-concurrency 16 \
  2>&1 | grep -E "Output token|Mean TPOT|Mean TTFT|client cpu"
snap > /tmp/threads_after.txt
join /tmp/threads_before.txt /tmp/threads_after.txt | awk '{printf "thread %s %.2f s\n", $1, ($3-$2)/100}'
kill $SP; wait $SP 2>/dev/null
