import sys, time, random, statistics
import kvloom
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom import SamplingParams
path, length = sys.argv[1], int(sys.argv[2])
eng = LLMEngine(EngineConfig.from_kwargs(path, dtype="bfloat16", num_blocks=2048, max_num_batched_tokens=8192, enable_prefix_caching=False))
params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
rng = random.Random(0)
times = []
for _ in range(6):
    eng.add_request([rng.randrange(10, 40000) for _ in range(length)], params)
    t = time.perf_counter(); eng.step(); times.append((time.perf_counter() - t) * 1000)
print(kvloom.__file__, "prefill", length, "median", round(statistics.median(times[1:]), 1), [round(t) for t in times])
