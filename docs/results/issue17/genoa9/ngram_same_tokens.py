"""Greedy output with and without n-gram speculation on the offline ShareGPT workload's
token ids: the same tokens, request by request (what makes the two throughputs comparable).

    .venv/bin/python docs/results/issue17/genoa9/ngram_same_tokens.py WORKLOAD.jsonl [NUM] [CAP]
"""
import json
import sys
from pathlib import Path

from kvloom import LLM, SamplingParams

path, num = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 200
cap = int(sys.argv[3]) if len(sys.argv) > 3 else 10 ** 9
rows = [json.loads(line) for line in open(path)][:num]
model = str(Path.home() / "kvloom-peers/models/smollm2-135m-instruct")
prompts = [row["prompt_token_ids"] for row in rows]
params = [SamplingParams(max_tokens=min(row["max_tokens"], cap), temperature=0.0, ignore_eos=True) for row in rows]
outputs = {}
for name, spec in (("off", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})):
    llm = LLM(model, dtype="bfloat16", kv_cache_memory=4, max_num_seqs=256, speculative_config=spec)
    outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
same = sum(a == b for a, b in zip(outputs["off"], outputs["ngram"]))
tokens = sum(len(a) for a in outputs["off"])
print(f"{len(rows)} requests, {tokens} output tokens: {same} identical with and without ngram speculation")
for i, (a, b) in enumerate(zip(outputs["off"], outputs["ngram"])):
    if a != b:
        first = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y) if a[:len(b)] != b[:len(a)] else min(len(a), len(b))
        print(f"  request {i}: first difference at output token {first}")
