#!/bin/bash
# DeepSeek-V2-Lite's attention shape (genoa36/v2lite_layers.py, 4 dense layers) at the session's start
# (3f832be, a worktree) and now, alternating: `bash v2lite_ab.sh START_TREE ROUNDS` from the
# repository root; each side from its own tree (PYTHONPATH first, the script outside the repo).
set -e
ROOT=$PWD; START=${1:-/tmp/s37/start}; ROUNDS=${2:-2}
cp "$ROOT/docs/results/issue17/genoa36/v2lite_layers.py" /tmp/s37/v2lite_layers.py
for round in $(seq 1 "$ROUNDS"); do
  for side in start now; do
    if [ "$side" = start ]; then tree=$START; else tree=$ROOT; fi
    PYTHONPATH=$tree "$ROOT/.venv/bin/python" /tmp/s37/v2lite_layers.py /tmp/s37/v2lite_$side 2>&1 \
      | grep -E "^(prefill|decode|kvloom from)" | sed "s/^/$side $round: /"
  done
done
