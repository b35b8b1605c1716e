"""Single-walk decode steps with the KV fetch on (MiB values) and off, alternating in one process.
usage: PYTHONPATH=/tmp/s13/ab python single_fetch.py BATCH ROUNDS CTX MIB..."""
import random, statistics, sys, time
import kvloom
assert "/tmp/s13/ab" in kvloom.__file__
import kvloom.models.decoder_stack as stack
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.models.default_model import resolve_default_model
from kvloom.sampling_params import SamplingParams
batch, rounds, ctx = (int(v) for v in sys.argv[1:4])
settings = [0] + [float(v) for v in sys.argv[4:]]
steps_per = 5
engine = LLMEngine(EngineConfig.from_kwargs(str(resolve_default_model()), dtype="bfloat16", enable_prefix_caching=False,
                                            max_num_seqs=256, num_blocks=batch * (ctx + 300) // 16 + 200))
rng = random.Random(0)
params = SamplingParams(max_tokens=rounds * len(settings) * (steps_per + 1) + 60, temperature=0.0, ignore_eos=True)
for _ in range(batch):
    engine.add_request([rng.randrange(10, 40000) for _ in range(ctx)], params)
while not (outputs := engine.step()) or not (len(outputs) == batch and all(o.outputs[0].token_ids for o in outputs)):
    pass
for _ in range(3):
    engine.step()
times = {s: [] for s in settings}
for r in range(rounds):
    for s in settings if r % 2 == 0 else settings[::-1]:
        stack.SINGLE_WALK_PREFETCH = int(s * (1 << 20))
        engine.step()
        for _ in range(steps_per):
            start = time.perf_counter(); engine.step(); times[s].append(time.perf_counter() - start)
for s, values in times.items():
    print(f"batch {batch} context {ctx} single-walk fetch {s:4.1f} MiB: median {statistics.median(values) * 1e3:7.2f} ms min {min(values) * 1e3:7.2f}")
