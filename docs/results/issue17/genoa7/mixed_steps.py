"""Mixed steps (BATCH decodes at ~CONTEXT plus one new PROMPT-token request each step), one walk against two
(the split balanced on q x (600 + context) a sequence), alternating blocks of STEPS steps in one process.

    .venv/bin/python docs/results/issue17/genoa7/mixed_steps.py BATCH CONTEXT PROMPT STEPS
"""
import sys, time, random, statistics
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import SamplingParams
from kvloom.models.default_model import resolve_default_model
import kvloom.models.decoder_stack as ds
batch, context, prompt, steps = (int(a) for a in sys.argv[1:5])
eng = LLMEngine(EngineConfig.from_kwargs(str(resolve_default_model()), dtype="bfloat16", enable_prefix_caching=False,
                max_num_seqs=256, num_blocks=(batch * (context + 16 * steps + 64) + 16 * steps * (prompt + 16)) // 16 + 64))
rng = random.Random(0)
for _ in range(batch):
    eng.add_request([rng.randrange(10, 40000) for _ in range(context)], SamplingParams(max_tokens=16 * steps + 40, temperature=0.0, ignore_eos=True))
while True:
    outs = eng.step()
    if len(outs) == batch and all(o.outputs[0].token_ids for o in outs): break
original = ds.split_point
def mixed(query_lens, seq_lens, threads):
    if threads != 2 or len(query_lens) < ds.SPLIT_FROM_TOKENS:
        return 0
    costs = [q * ds.ROW_COST_IN_CONTEXT_TOKENS + q * s for q, s in zip(query_lens, seq_lens)]
    half, total = sum(costs) / 2, 0.0
    for i, c in enumerate(costs):
        if total + c / 2 >= half:
            return max(1, min(i, len(costs) - 1))
        total += c
    return len(costs) - 1
times = {"one": [], "two": []}
for r in range(8):
    for mode in (("one", "two") if r % 2 == 0 else ("two", "one")):
        ds.split_point = mixed if mode == "two" else (lambda *a: 0)
        for _ in range(steps):
            eng.add_request([rng.randrange(10, 40000) for _ in range(prompt)], SamplingParams(max_tokens=1, temperature=0.0))
            t = time.perf_counter(); eng.step(); times[mode].append(time.perf_counter() - t)
for mode, ts in times.items():
    print(f"{batch} decodes x {context} + a {prompt}-token prompt: {mode} walk(s) median {statistics.median(ts)*1e3:.2f} ms")
