"""Per-kernel time inside the native decoder stack (timers.py: the instrumented build) over the
ShareGPT run's first prompt steps (2,048 tokens each; the first one untimed).
    PYTHONPATH=/tmp/s13/wt .venv/bin/python docs/results/issue17/genoa13/prompt_times.py STEPS"""
import statistics
import sys
from pathlib import Path

from timers import StackTimers, timed_steps

from kvloom.bench import datasets
from kvloom.bench.offline import warm_up
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import SamplingParams

steps = int(sys.argv[1])
timers = StackTimers()
model = str(Path.home() / "kvloom-peers/models/smollm2-135m-instruct")
engine = LLMEngine(EngineConfig.from_kwargs(model, dtype="bfloat16", kv_cache_memory=4, max_num_seqs=256,
                                            enable_prefix_caching=False))
warm_up(engine)
for request in datasets.load_token_workload(Path.home() / "kvloom-peers/workloads/sharegpt200.jsonl", 200):
    engine.add_request(request.prompt_token_ids, SamplingParams(max_tokens=request.expected_output_len,
                                                                temperature=0.0, ignore_eos=True))
engine.step()
timers.start()
seconds = timed_steps(engine, steps)
per_step = timers.stop(steps)
print(f"step median {statistics.median(seconds) * 1e3:.1f} ms, mean {statistics.mean(seconds) * 1e3:.1f}")
for name, (ms, _) in per_step.items():
    print(f"  {name:10s} {ms:8.2f} ms/step")
print(f"  sum        {sum(ms for ms, _ in per_step.values()):8.2f}")
