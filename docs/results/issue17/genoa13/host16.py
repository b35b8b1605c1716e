"""A decode step's host work at BATCH x 300, phase by phase (wrappers with perf_counter)."""
import sys, time, random, statistics, functools
from collections import defaultdict
import kvloom.batch as kb
import kvloom.kernels.decoder_stack as kds
import kvloom.runner.sampling_metadata as sm
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import SamplingParams
from kvloom.models.default_model import resolve_default_model
batch = int(sys.argv[1]); steps = int(sys.argv[2]); ctx = 300
eng = LLMEngine(EngineConfig.from_kwargs(str(resolve_default_model()), dtype="bfloat16", enable_prefix_caching=False,
                max_num_seqs=256, num_blocks=6000))
rng = random.Random(0)
from kvloom.sampling_params import RequestOutputKind
params = SamplingParams(max_tokens=steps + 40, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
for _ in range(batch):
    eng.add_request([rng.randrange(10, 40000) for _ in range(ctx - steps // 2)], params)
for _ in range(12): eng.step()
acc = defaultdict(float)
def wrap(obj, name, label):
    fn = getattr(obj, name)
    @functools.wraps(fn)
    def w(*a, **k):
        t = time.perf_counter()
        try: return fn(*a, **k)
        finally: acc[label] += time.perf_counter() - t
    setattr(obj, name, w)
wrap(eng.scheduler, "schedule", "schedule")
wrap(eng.runner, "launch", "launch")
wrap(eng, "_commit", "commit")
wrap(eng.scheduler, "advance", "advance")
model = eng.runner.model
wrap(model, "forward", "  forward")
wrap(model, "compute_logits", "  compute_logits")
wrap(kds, "run", "    stack kernels.run")
wrap(kb.ForwardBatch, "build", "  ForwardBatch.build")
wrap(eng.runner.backend, "prepare", "  backend.prepare")
wrap(eng.runner.sampler, "sample", "  sampler.sample")
wrap(sm.SamplingMetadata, "build", "    SamplingMetadata.build")
wrap(eng.runner, "finish", "  finish")
total = []
for _ in range(steps):
    t = time.perf_counter(); eng.step(); total.append(time.perf_counter() - t)
print(f"batch {batch}: step mean {statistics.mean(total)*1e3:.2f} ms median {statistics.median(total)*1e3:.2f}")
for k, v in acc.items():
    print(f"  {k:32s} {v/steps*1e3:7.3f} ms")
