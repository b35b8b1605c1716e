"""Per-kernel time inside the native decoder stack (timers.py: the instrumented build) for
prompt steps of SEQS prompts of LEN tokens, per step and per token.
    PYTHONPATH=/tmp/s13/wt .venv/bin/python docs/results/issue17/genoa13/prompt_kernels.py SEQS LEN STEPS"""
import random
import statistics
import sys
import time

from timers import StackTimers

from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.models.default_model import resolve_default_model
from kvloom.sampling_params import SamplingParams

seqs, length, steps = (int(v) for v in sys.argv[1:4])
timers = StackTimers()
engine = LLMEngine(EngineConfig.from_kwargs(str(resolve_default_model()), dtype="bfloat16",
                                            enable_prefix_caching=False, max_num_seqs=256, num_blocks=8000,
                                            max_num_batched_tokens=max(2048, seqs * length)))
rng = random.Random(0)
params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def prompt_step() -> float:
    """Seconds of one step that prefills SEQS new prompts (each done after its one token)."""
    for _ in range(seqs):
        engine.add_request([rng.randrange(10, 40000) for _ in range(length)], params)
    start = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return seconds


prompt_step(), prompt_step()
timers.start()
seconds = [prompt_step() for _ in range(steps)]
per_step = timers.stop(steps)
print(f"{seqs} x {length}: step median {statistics.median(seconds) * 1e3:.1f} ms")
for name, (ms, _) in per_step.items():
    print(f"  {name:10s} {ms:8.2f} ms/step  {ms * 1e3 / (seqs * length):7.3f} us/token")
