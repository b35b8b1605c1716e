#!/usr/bin/env bash
# Issue 22: prefix reuse for state-space models, measured both ways.
# 1. `kvloom bench families` for the Mamba2 and hybrid shapes (and Llama for scale):
#    the step computing 16 tokens after a 512-token hit (a state checkpoint restored),
#    one state slot's copy, and the 512-token prefill a miss computes.
# 2. A shared-system-prompt workload on the hybrid: 32 requests of one 512-token
#    prefix + 64 own tokens, 32 tokens out each, with state checkpoints (the default)
#    and without (--num-state-checkpoints 0: prefix caching off).
# Run from the repository root on a quiet machine; writes next to this script.
set -euo pipefail
here=docs/results/issue22
py=.venv/bin/python
kvloom=.venv/bin/kvloom
$kvloom bench families --families llama,mamba2,hybrid --output-json $here/families_prefix.json | tee $here/families_prefix.txt
$py - <<'PY'
import json, random
rng = random.Random(22)
prefix = [rng.randrange(10, 49152) for _ in range(512)]
with open("docs/results/issue22/shared_prefix.jsonl", "w") as f:
    for _ in range(32):
        f.write(json.dumps({"prompt_token_ids": prefix + [rng.randrange(10, 49152) for _ in range(64)],
                            "max_tokens": 32}) + "\n")
PY
for mode in checkpoints off; do
  extra=(); [ "$mode" = off ] && extra=(--num-state-checkpoints 0)
  $kvloom bench offline /tmp/kvloom-families/hybrid --dataset tokens --dataset-path $here/shared_prefix.jsonl \
    --num-prompts 32 --lead 1 --dtype bfloat16 "${extra[@]}" --output-json $here/hybrid_shared_prefix_$mode.json \
    | tee $here/hybrid_shared_prefix_$mode.txt
done
