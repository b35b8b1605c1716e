#!/bin/bash
# Decode-step medians (bench steps) under a busy/idle interferer (interfere.py BUSY_MS IDLE_MS),
# per OpenMP setting; run from the repository root. BUSY=0 IDLE=1000: no load.
run() { echo "== $*"; env "$@" .venv/bin/python -m kvloom bench steps --batches 1,16,64 --decode-steps 40 \
          --prefill 1x16 --repeats 1 --dtype bfloat16 2>&1 | grep decode; }
python3 docs/results/issue17/interfere.py ${BUSY:-1} ${IDLE:-7} & IP=$!
for pass in 1 2; do
  run X=default
  run GOMP_SPINCOUNT=20000
  run OMP_WAIT_POLICY=PASSIVE
  run OMP_PROC_BIND=close OMP_PLACES=cores
done
kill $IP
