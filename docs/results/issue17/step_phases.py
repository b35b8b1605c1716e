"""Split a decode step into phases by wrapping the step's functions with timers.

Usage (repository root): .venv/bin/python docs/results/issue17/step_phases.py BATCH [STEPS]
(the default model, bf16, context 300)."""
import sys, time, random, statistics, collections, functools
import torch
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import SamplingParams
import kvloom.batch as kb
from kvloom.models.default_model import resolve_default_model
import kvloom.runner.model_runner as mr
import kvloom.runner.sampling_metadata as sm

batch = int(sys.argv[1]); steps = int(sys.argv[2]) if len(sys.argv) > 2 else 40
eng = LLMEngine(EngineConfig.from_kwargs(str(resolve_default_model()), dtype="bfloat16", enable_prefix_caching=False,
                max_num_seqs=256, num_blocks=4000))
T = collections.defaultdict(float)
def wrap(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); T[label] += time.perf_counter() - t; return r
    setattr(obj, name, g)
wrap(eng.scheduler, "schedule", "schedule")
wrap(eng.scheduler, "update", "update")
wrap(kb.ForwardBatch, "build", "build")
wrap(eng.runner.backend, "prepare", "prepare")
wrap(eng.model, "forward", "model")
wrap(eng.model, "compute_logits", "logits")
wrap(eng.runner.sampler, "sample", "sampler")
wrap(sm.SamplingMetadata, "build", "sampmeta")
wrap(eng, "_output", "output")
rng = random.Random(0)
params = SamplingParams(max_tokens=steps + 40, temperature=0.0, ignore_eos=True)
for _ in range(batch):
    eng.add_request([rng.randrange(10, 40000) for _ in range(300)], params)
while True:
    outs = eng.step()
    if len(outs) == batch and all(o.outputs[0].token_ids for o in outs): break
for _ in range(5): eng.step()
T.clear(); total = []
for _ in range(steps):
    t = time.perf_counter(); eng.step(); total.append(time.perf_counter() - t)
n = steps
print(f"b{batch} step median {statistics.median(total)*1e3:.2f} mean {sum(total)/n*1e3:.2f} ms")
for k, v in T.items(): print(f"  {k:10s} {v/n*1e3:7.3f} ms")
