"""Engine steps that only compute prompts: 2,048 tokens a step as 2048/LENGTH fresh random
prompts (max_tokens 1, no prefix caching), N steps; prints each step's ms.

    .venv/bin/python docs/results/issue17/genoa10/prefill_step.py [N] [LENGTH]
"""
import random
import statistics
import sys
import time
from pathlib import Path

from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import SamplingParams

model = str(Path.home() / "kvloom-peers/models/smollm2-135m-instruct")
eng = LLMEngine(EngineConfig.from_kwargs(model, dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=256,
                                         kv_cache_memory=4))
rng = random.Random(0)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 12
length = int(sys.argv[2]) if len(sys.argv) > 2 else 256
times = []
for _i in range(n):
    for _j in range(2048 // length):
        eng.add_request([rng.randrange(100, 40000) for _ in range(length)],
                        SamplingParams(max_tokens=1, ignore_eos=True))
    s = time.perf_counter()
    eng.step()
    times.append(time.perf_counter() - s)
    while eng.has_unfinished_requests():
        eng.step()
print("prefill steps ms:", [round(t*1e3) for t in times], "median", round(statistics.median(times[2:])*1e3, 1))
