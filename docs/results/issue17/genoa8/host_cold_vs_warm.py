"""The host's work per decode step in real steps (step minus the native compute calls) and with
the compute stubbed out (nothing streams through the caches), alternating on one engine.

    .venv/bin/python docs/results/issue17/genoa8/host_cold_vs_warm.py BATCH
"""
import random, sys, time, statistics
import torch
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import SamplingParams
from kvloom.models.default_model import resolve_default_model
from kvloom.kernels import decoder_stack, gemm
batch=int(sys.argv[1]); steps=40
eng = LLMEngine(EngineConfig.from_kwargs(str(resolve_default_model()), dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=256, num_blocks=4000))
rng = random.Random(0)
params = SamplingParams(max_tokens=3*steps + 40, temperature=0.0, ignore_eos=True)
for _ in range(batch): eng.add_request([rng.randrange(10, 40000) for _ in range(300)], params)
for _ in range(10): eng.step()
run, g = decoder_stack.run, gemm.gemm_bf16
inside=[0.0]
def trun(*a, **k):
    t=time.perf_counter(); r=run(*a, **k); inside[0]+=time.perf_counter()-t; return r
def tg(*a, **k):
    t=time.perf_counter(); r=g(*a, **k); inside[0]+=time.perf_counter()-t; return r
cache={}
def stub_run(kernels, weights, shape, residual, *a, **k): return torch.zeros_like(residual)
def stub_g(x, packed, bias, n, isa):
    key=(x.shape[0], n)
    if key not in cache: cache[key]=torch.zeros(x.shape[0], n, dtype=torch.bfloat16)
    return cache[key]
def measure(label):
    host=[]
    for _ in range(steps):
        inside[0]=0.0; t=time.perf_counter(); eng.step(); host.append(time.perf_counter()-t-inside[0])
    print(label, f"host median {statistics.median(host)*1e3:.3f} ms")
decoder_stack.run, gemm.gemm_bf16 = trun, tg
measure("real compute (host = step - native):")
decoder_stack.run, gemm.gemm_bf16 = stub_run, stub_g
measure("stubbed compute (warm host):")
decoder_stack.run, gemm.gemm_bf16 = trun, tg
measure("real compute again:")
