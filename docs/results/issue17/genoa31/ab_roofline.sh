#!/usr/bin/env bash
# A/B of the decode steps against their bound: this tree (HEAD) against another revision's
# worktree (A), alternating, ROUNDS rounds: `kvloom bench roofline --batches B --context 300
# --steps 40` in each. Usage: A=/path/to/worktree ROUNDS=3 BATCHES=1,16,64 bash ab_roofline.sh OUTDIR
set -euo pipefail
OUT=${1:?outdir}; A=${A:?worktree of the other revision}; ROUNDS=${ROUNDS:-3}; BATCHES=${BATCHES:-1,16,64}
HEAD_DIR=$(git rev-parse --show-toplevel); PY=$HEAD_DIR/.venv/bin/python
mkdir -p "$OUT"
for r in $(seq 1 "$ROUNDS"); do
  for side in a head; do
    dir=$([ $side = a ] && echo "$A" || echo "$HEAD_DIR")
    (cd "$dir" && PYTHONPATH="$dir" "$PY" -m kvloom bench roofline --batches "$BATCHES" --context 300 --steps 40) \
      > "$OUT/${side}_$r.txt" 2>&1
    echo "$side round $r: $(grep -E '^ +(1|16|64) +40 ' "$OUT/${side}_$r.txt" | awk '{printf "b%s %s ms (%s)  ", $1, $4, $6}')"
  done
done
