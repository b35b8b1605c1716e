"""The model forward alone, the native decoder stack vs the modules, interleaved in one
process on the same batch. Usage: .venv/bin/python docs/results/issue17/forward_native_vs_modules.py BATCH [REPEATS]"""
import sys, time, random, statistics
import torch
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import SamplingParams
from kvloom.models.default_model import resolve_default_model
from kvloom.batch import ForwardBatch
batch = int(sys.argv[1])
eng = LLMEngine(EngineConfig.from_kwargs(str(resolve_default_model()), dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=256, num_blocks=4000))
rng = random.Random(0)
for _ in range(batch):
    eng.add_request([rng.randrange(10, 40000) for _ in range(300)], SamplingParams(max_tokens=100000, temperature=0.0, ignore_eos=True))
for _ in range(30): eng.step()
out = eng.scheduler.schedule()
r = eng.runner
fb = ForwardBatch.build(out, r.block_size, r.device)
md = r.backend.prepare(fb)
model = eng.model; stack = model.native_stack
res = {"native": [], "modules": []}
with torch.inference_mode():
  for rep in range(int(sys.argv[2]) if len(sys.argv) > 2 else 200):
    for mode in ("native", "modules"):
        model.native_stack = stack if mode == "native" else None
        t = time.perf_counter(); model(fb, r.kv_caches, r.backend, md); res[mode].append(time.perf_counter() - t)
for k, v in res.items(): print(f"b{batch} {k}: median {statistics.median(v)*1e3:.3f} ms  min {min(v)*1e3:.3f}")
