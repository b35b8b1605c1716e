#!/bin/bash
# A random-weight model script of this folder or the last (v2lite_layers.py: DeepSeek-V2-Lite's attention
# shape, 4 dense layers; mla_moe_layers.py: the MLA shape with DeepSeek-V2's experts) at the session's
# start (3f832be, a worktree) and now, alternating: `bash layers_ab.sh SCRIPT START_TREE ROUNDS` from the
# repository root, SCRIPT a path from it; each side from its own tree (PYTHONPATH first, the script
# copied outside the repository, where Python would put its directory first on sys.path).
set -e
ROOT=$PWD; SCRIPT=$1; START=${2:-/tmp/s37/start}; ROUNDS=${3:-2}
NAME=$(basename "$SCRIPT" .py)
cp "$ROOT/$SCRIPT" "/tmp/s37/$NAME.py"
for round in $(seq 1 "$ROUNDS"); do
  for side in start now; do
    if [ "$side" = start ]; then tree=$START; else tree=$ROOT; fi
    PYTHONPATH=$tree "$ROOT/.venv/bin/python" "/tmp/s37/$NAME.py" "/tmp/s37/${NAME}_$side" 2>&1 \
      | grep -E "^(prefill|decode|kvloom from|native walk)" | sed "s/^/$side $round: /"
  done
done
