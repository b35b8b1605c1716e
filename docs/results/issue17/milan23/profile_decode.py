"""Where a decode step's time goes, from the engine's own profiler (engine/profiler.py):
the default model (bf16), 16 requests of 300 prompt tokens, their prompts computed first,
then 20 decode steps under ``start_profile`` / ``stop_profile``; each op's self time
(torch's profiler, per op name) summed over the steps and divided by them. The step
times with and without the profiler are timed in the same process (its cost).

    .venv/bin/python docs/results/issue17/milan23/profile_decode.py [BATCH] [CONTEXT]
"""

from __future__ import annotations

import random
import sys
import tempfile
import time

from kvloom import SamplingParams
from kvloom.config import DEFAULT_MODEL, EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.engine.profiler import write_trace

BATCH = int(sys.argv[1]) if len(sys.argv) > 1 else 16
CONTEXT = int(sys.argv[2]) if len(sys.argv) > 2 else 300
STEPS = 20


def decode_steps(engine: LLMEngine, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(DEFAULT_MODEL, max_num_batched_tokens=BATCH * CONTEXT,
                                                enable_prefix_caching=False))
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=3 * STEPS + 2, ignore_eos=True)
    for i in range(BATCH):
        engine.add_request([rng.randrange(100, 40000) for _ in range(CONTEXT)], params, request_id=str(i))
    engine.step()  # every prompt, and the first tokens
    plain = decode_steps(engine, STEPS)
    engine.start_profile()
    profiled = decode_steps(engine, STEPS)
    recording = engine.profiler.stop()
    trace = write_trace(recording, tempfile.mkdtemp())
    print(f"batch {BATCH}, context ~{CONTEXT}: decode step {plain:.2f} ms plain, {profiled:.2f} ms profiled")
    print(f"trace: {trace}")
    rows = sorted(recording.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) / STEPS / 1e3
    print(f"{'op':36} {'ms/step':>8} {'share':>6} {'calls/step':>10}")
    for event in rows[:14]:
        ms = event.self_cpu_time_total / STEPS / 1e3
        print(f"{event.key:36} {ms:8.2f} {ms / total:6.1%} {event.count / STEPS:10.1f}")
    print(f"{'all ops (self time)':36} {total:8.2f}")


if __name__ == "__main__":
    main()
