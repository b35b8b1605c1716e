"""Decode steps at BATCH x CONTEXT with one walk and with two (csrc/decoder_stack.cpp), alternating blocks of
STEPS steps in one process (8 blocks each).

    .venv/bin/python docs/results/issue17/genoa7/two_walks_steps.py BATCH CONTEXT STEPS
"""
import sys, time, random, statistics
import torch
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import SamplingParams
from kvloom.models.default_model import resolve_default_model
import kvloom.models.decoder_stack as ds
batch, context, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
eng = LLMEngine(EngineConfig.from_kwargs(str(resolve_default_model()), dtype="bfloat16", enable_prefix_caching=False,
                max_num_seqs=256, num_blocks=(batch * (context + 8 * steps + 64)) // 16 + 64))
rng = random.Random(0)
params = SamplingParams(max_tokens=8 * steps + 40, temperature=0.0, ignore_eos=True)
for _ in range(batch):
    eng.add_request([rng.randrange(10, 40000) for _ in range(context)], params)
while True:
    outs = eng.step()
    if len(outs) == batch and all(o.outputs[0].token_ids for o in outs): break
times = {"one": [], "two": []}
for r in range(8):
    for mode in (("one", "two") if r % 2 == 0 else ("two", "one")):
        ds.SPLIT_FROM_TOKENS = 1 if mode == "two" else 10**9
        for _ in range(steps):
            t = time.perf_counter(); eng.step(); times[mode].append(time.perf_counter() - t)
for mode, ts in times.items():
    print(f"b{batch} x {context}: {mode} walk(s) median {statistics.median(ts)*1e3:.2f} ms")
