#!/bin/bash
# The MLA shape with DeepSeek-V2's experts (mla_moe_layers.py) at the session's start
# (3f832be, a worktree) and now, alternating: `bash mla_moe_ab.sh START_TREE ROUNDS` from the
# repository root; each side from its own tree (PYTHONPATH first, the script outside the repo).
set -e
ROOT=$PWD; START=${1:-/tmp/s37/start}; ROUNDS=${2:-2}
cp "$ROOT/docs/results/issue17/genoa37/mla_moe_layers.py" /tmp/s37/mla_moe_layers.py
for round in $(seq 1 "$ROUNDS"); do
  for side in start now; do
    if [ "$side" = start ]; then tree=$START; else tree=$ROOT; fi
    PYTHONPATH=$tree "$ROOT/.venv/bin/python" /tmp/s37/mla_moe_layers.py /tmp/s37/mla_moe_$side 2>&1 \
      | grep -E "^(prefill|decode|kvloom from|native walk)" | sed "s/^/$side $round: /"
  done
done
