#!/bin/bash
# The families bench's MLA shape at the session's start (3f832be, a worktree) and now,
# alternating: `bash mla_ab.sh START_TREE ROUNDS OUT_DIR` from the repository root. Each side
# runs from its own tree's directory (python puts the working directory first on sys.path,
# ahead of PYTHONPATH and of the editable install).
set -e
ROOT=$PWD; START=${1:-/tmp/s37/start}; ROUNDS=${2:-2}; OUT=$(realpath "${3:-docs/results/issue17/genoa37}")
for round in $(seq 1 "$ROUNDS"); do
  for side in start now; do
    if [ "$side" = start ]; then tree=$START; else tree=$ROOT; fi
    (cd "$tree" && "$ROOT/.venv/bin/python" -c "import kvloom, sys; sys.stderr.write(kvloom.__file__ + '\n')" \
       && "$ROOT/.venv/bin/python" -m kvloom bench families --families mla --batches 1,16,64 --context 512 \
          --workdir /tmp/s37/fam --output-json "$OUT/mla_${side}_$round.json" 2>&1 | grep -E "^mla" \
          | sed "s/^/$side $round: /")
  done
done
