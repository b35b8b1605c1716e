"""Decode steps over varied contexts: the KV fetch off, in sequence order, and in the attention's order
(longest first), alternating in one process. usage: PYTHONPATH=/tmp/s13/ab python kv_order_steps.py BATCH ROUNDS LO HI"""
import ctypes, random, statistics, sys, time
import kvloom, kvloom.native as native
assert "/tmp/s13/ab" in kvloom.__file__
import kvloom.models.decoder_stack as stack
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.models.default_model import resolve_default_model
from kvloom.sampling_params import SamplingParams
batch, rounds, lo, hi = (int(v) for v in sys.argv[1:5])
settings = [("off", 0, 0), ("index 8", 8, 0), ("sorted 8", 8, 1), ("sorted 12", 12, 1)]
steps_per = 5
engine = LLMEngine(EngineConfig.from_kwargs(str(resolve_default_model()), dtype="bfloat16", enable_prefix_caching=False,
                                            max_num_seqs=256, num_blocks=batch * (hi + 300) // 16 + 200))
lib = native.load("decoder_stack")
rng = random.Random(0)
params = SamplingParams(max_tokens=rounds * len(settings) * (steps_per + 1) + 60, temperature=0.0, ignore_eos=True)
for _ in range(batch):
    engine.add_request([rng.randrange(10, 40000) for _ in range(rng.randrange(lo, hi))], params)
while not (outputs := engine.step()) or not (len(outputs) == batch and all(o.outputs[0].token_ids for o in outputs)):
    pass
for _ in range(3):
    engine.step()
times = {name: [] for name, _, _ in settings}
for r in range(rounds):
    for name, mib, sort in settings if r % 2 == 0 else settings[::-1]:
        stack.KV_PREFETCH_BYTES = mib << 20
        lib.kvloom_stack_set_sorted(sort)
        engine.step()
        for _ in range(steps_per):
            start = time.perf_counter(); engine.step(); times[name].append(time.perf_counter() - start)
for name, values in times.items():
    print(f"batch {batch} contexts {lo}-{hi} {name:10s}: median {statistics.median(values) * 1e3:7.2f} ms min {min(values) * 1e3:7.2f}")
