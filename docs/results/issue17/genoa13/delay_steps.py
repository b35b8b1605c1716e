"""Split decode steps with walk 2 started DELAY us after walk 1 (phases apart), alternating in one process.
usage: PYTHONPATH=/tmp/s13/ab python delay_steps.py BATCH ROUNDS LO HI D1 D2 ..."""
import ctypes, random, statistics, sys, time
import kvloom, kvloom.native as native
assert "/tmp/s13/ab" in kvloom.__file__
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.models.default_model import resolve_default_model
from kvloom.sampling_params import SamplingParams
batch, rounds, lo, hi = (int(v) for v in sys.argv[1:5])
settings = [int(v) for v in sys.argv[5:]]
steps_per = 5
engine = LLMEngine(EngineConfig.from_kwargs(str(resolve_default_model()), dtype="bfloat16", enable_prefix_caching=False,
                                            max_num_seqs=256, num_blocks=batch * (hi + 300) // 16 + 200))
lib = native.load("decoder_stack")
rng = random.Random(0)
params = SamplingParams(max_tokens=rounds * len(settings) * (steps_per + 1) + 60, temperature=0.0, ignore_eos=True)
for _ in range(batch):
    engine.add_request([rng.randrange(10, 40000) for _ in range(rng.randrange(lo, hi + 1))], params)
while not (outputs := engine.step()) or not (len(outputs) == batch and all(o.outputs[0].token_ids for o in outputs)):
    pass
for _ in range(3):
    engine.step()
times = {d: [] for d in settings}
for r in range(rounds):
    for d in settings if r % 2 == 0 else settings[::-1]:
        lib.kvloom_stack_set_delay(d)
        engine.step()
        for _ in range(steps_per):
            start = time.perf_counter(); engine.step(); times[d].append(time.perf_counter() - start)
for d, values in times.items():
    print(f"batch {batch} contexts {lo}-{hi} delay {d:5d} us: median {statistics.median(values) * 1e3:7.2f} ms min {min(values) * 1e3:7.2f}")
