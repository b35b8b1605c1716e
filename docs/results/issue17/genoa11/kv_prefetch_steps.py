"""Decode steps with the decoder stack's KV fetched ahead (KV_PREFETCH_BYTES) and without,
alternating in one process: median and min ms a step for each setting (MiB).

    .venv/bin/python docs/results/issue17/genoa11/kv_prefetch_steps.py BATCH ROUNDS MIB [MIB ...]
    (CTX=300 in the environment sets the prompt length; the default model, bf16)
"""
import os
import random
import statistics
import sys
import time

import kvloom.models.decoder_stack as stack
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.models.default_model import resolve_default_model
from kvloom.sampling_params import SamplingParams

batch, rounds = int(sys.argv[1]), int(sys.argv[2])
settings = [0.0] + [float(v) for v in sys.argv[3:]]
ctx, steps_per = int(os.environ.get("CTX", "300")), 6
engine = LLMEngine(EngineConfig.from_kwargs(str(resolve_default_model()), dtype="bfloat16", enable_prefix_caching=False,
                                            max_num_seqs=256, num_blocks=batch * (ctx + 200) // 16 + 200))
rng = random.Random(0)
params = SamplingParams(max_tokens=rounds * len(settings) * (steps_per + 1) + 60, temperature=0.0, ignore_eos=True)
for _ in range(batch):
    engine.add_request([rng.randrange(10, 40000) for _ in range(ctx)], params)
while not (outputs := engine.step()) or not (len(outputs) == batch and all(o.outputs[0].token_ids for o in outputs)):
    pass
for _ in range(5):
    engine.step()
times: dict[float, list[float]] = {s: [] for s in settings}
for r in range(rounds):
    for mib in settings if r % 2 == 0 else settings[::-1]:
        stack.KV_PREFETCH_BYTES = int(mib * (1 << 20))
        engine.step()
        for _ in range(steps_per):
            start = time.perf_counter()
            engine.step()
            times[mib].append(time.perf_counter() - start)
for mib, values in times.items():
    print(f"batch {batch} context {ctx} prefetch {mib:5.1f} MiB: median {statistics.median(values) * 1e3:7.2f} ms "
          f"min {min(values) * 1e3:7.2f} ({len(values)} steps)")
