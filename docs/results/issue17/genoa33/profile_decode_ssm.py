import sys, time, torch
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom import SamplingParams
from kvloom.request import Request
path = sys.argv[1]; batch = int(sys.argv[2])
eng = LLMEngine(EngineConfig.from_kwargs(path, dtype="bfloat16", num_blocks=2048, max_num_seqs=128, max_num_batched_tokens=8192))
params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
import random
rng = random.Random(0)
for i in range(batch):
    eng.add_request([rng.randrange(10, 40000) for _ in range(300)], params, request_id=f"r{i}")
while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running) or eng.scheduler.waiting:
    eng.step()
for _ in range(3): eng.step()
from torch.profiler import profile, ProfilerActivity
times=[]
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(5):
        t=time.perf_counter(); eng.step(); times.append((time.perf_counter()-t)*1000)
print("steps ms", [round(t,1) for t in times])
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
