#!/usr/bin/env bash
# Issue 21 (part 1): the kvloom.lang workloads of examples/lang_programs.py on the default
# model (SmolLM2-135M-Instruct, bf16), in-process, radix cache on, then off, one after
# the other on a quiet machine.
set -euo pipefail
OUT=docs/results/issue21
.venv/bin/python examples/lang_programs.py > "$OUT/cache_on.jsonl"
.venv/bin/python examples/lang_programs.py --no-prefix-cache > "$OUT/cache_off.jsonl"
