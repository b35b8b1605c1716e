"""Python and torch right after the native decoder stack returns (cold) and again at once
(warm), inside real decode steps: a 200-iteration loop, then empty_like + clone.

    .venv/bin/python docs/results/issue17/genoa8/python_after_stack.py BATCH
"""
import random, sys, time, statistics
import torch
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import SamplingParams
from kvloom.models.default_model import resolve_default_model
from kvloom.kernels import decoder_stack
batch=int(sys.argv[1]); steps=60
eng = LLMEngine(EngineConfig.from_kwargs(str(resolve_default_model()), dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=256, num_blocks=4000))
run = decoder_stack.run; A=[];B=[];C=[]
x=torch.randn(16,576).bfloat16()
def busy():
    s=0
    for i in range(200): s+=i
    return s
def g(*a, **k):
    y = run(*a, **k)
    t0=time.perf_counter(); busy(); t1=time.perf_counter(); busy(); t2=time.perf_counter()
    torch.empty_like(x); x.clone(); t3=time.perf_counter(); torch.empty_like(x); x.clone(); t4=time.perf_counter()
    A.append((t1-t0, t2-t1, t3-t2, t4-t3)); return y
decoder_stack.run = g
rng = random.Random(0)
params = SamplingParams(max_tokens=steps + 40, temperature=0.0, ignore_eos=True)
for _ in range(batch): eng.add_request([rng.randrange(10, 40000) for _ in range(300)], params)
for _ in range(10): eng.step()
A.clear()
for _ in range(steps): eng.step()
print("python loop cold/warm, torch ops cold/warm (us):", [round(statistics.median(v)*1e6,1) for v in zip(*A)])
