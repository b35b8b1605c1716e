"""Per-kernel time inside the native decoder stack (timers.py: the instrumented build), decode
steps at BATCH x CONTEXT, with each matmul's rate per walk.
    PYTHONPATH=/tmp/s13/wt .venv/bin/python docs/results/issue17/genoa13/stack_times.py BATCH STEPS [CONTEXT]"""
import statistics
import sys

from alternate import decoding_engine
from timers import StackTimers, timed_steps

batch = int(sys.argv[1]); steps = int(sys.argv[2]); ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 300
timers = StackTimers()
engine = decoding_engine([ctx - steps // 2] * batch, rounds=steps, num_settings=1)
timers.start()
seconds = timed_steps(engine, steps)
per_step = timers.stop(steps)
weights = {"qkv": 576 * 960, "o": 576 * 576, "gate_up": 576 * 3072, "down": 1536 * 576}  # per layer
print(f"b{batch} ctx{ctx} step median {statistics.median(seconds) * 1e3:.2f} ms")
total = [0.0, 0.0]
for name, walks in per_step.items():
    total = [t + w for t, w in zip(total, walks, strict=True)]
    rate = ""
    if name in weights:
        rows = batch / (2 if walks[1] > 0 else 1)
        rate = "  GFLOP/s per walk " + " ".join(f"{2 * rows * weights[name] * 30 / (w * 1e-3) / 1e9:6.1f}"
                                               for w in walks if w > 0)
    print(f"  {name:10s} {walks[0]:7.3f} {walks[1]:7.3f} ms/step{rate}")
print(f"  sum        {total[0]:7.3f} {total[1]:7.3f}")
