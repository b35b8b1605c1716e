"""Decode steps at BATCH x CONTEXT: one walk, two walks, two walks meeting at every layer's end
(KVLOOM_WALK_SYNC=1), alternating blocks of STEPS steps in one process (8 rounds)."""
import os, sys, time, random, statistics
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import SamplingParams
from kvloom.models.default_model import resolve_default_model
import kvloom.models.decoder_stack as ds
batch, context, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
eng = LLMEngine(EngineConfig.from_kwargs(str(resolve_default_model()), dtype="bfloat16", enable_prefix_caching=False,
                max_num_seqs=256, num_blocks=(batch * (context + 24 * steps + 64)) // 16 + 64))
rng = random.Random(0)
params = SamplingParams(max_tokens=24 * steps + 40, temperature=0.0, ignore_eos=True)
for _ in range(batch):
    eng.add_request([rng.randrange(10, 40000) for _ in range(context)], params)
while True:
    outs = eng.step()
    if len(outs) == batch and all(o.outputs[0].token_ids for o in outs): break
modes = ["one", "two", "sync"]
times = {m: [] for m in modes}
for r in range(8):
    order = modes[r % 3:] + modes[:r % 3]
    for mode in order:
        ds.SPLIT_FROM_TOKENS = 10**9 if mode == "one" else 1
        os.environ["KVLOOM_WALK_SYNC"] = "1" if mode == "sync" else "0"
        for _ in range(steps):
            t = time.perf_counter(); eng.step(); times[mode].append(time.perf_counter() - t)
print(" ".join(f"{mode} {statistics.median(ts)*1e3:.2f}" for mode, ts in times.items()), f"ms (b{batch} x {context})")
