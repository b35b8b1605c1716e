"""Prompt steps with the last layer for the sampled rows alone (batch.output_rows) against
every row (output_rows cleared in ForwardBatch.build), alternating in one process: the
default model in bf16, PROMPTS random prompts of LENGTH tokens a round, max_tokens 1
(prefill only; 2,048-token steps), no prefix cache. Prints seconds a round and the medians.
Usage: prefill_rows.py [ROUNDS] [PROMPTS] [LENGTH]"""

from __future__ import annotations

import dataclasses
import random
import statistics
import sys
import time

from kvloom import batch as batch_module
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.models.default_model import resolve_default_model
from kvloom.sampling_params import SamplingParams

rounds, prompts, length = (int(a) for a in (sys.argv[1:] + ["6", "32", "256"][len(sys.argv) - 1:])[:3])
build = batch_module.ForwardBatch.build.__func__  # type: ignore[attr-defined]


def every_row(cls, *args, **kwargs):  # type: ignore[no-untyped-def]
    return dataclasses.replace(build(cls, *args, **kwargs), output_rows=None)


engine = LLMEngine(EngineConfig.from_kwargs(str(resolve_default_model()), dtype="bfloat16",
                                            enable_prefix_caching=False, max_num_seqs=256))
rng = random.Random(0)
params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
times: dict[str, list[float]] = {"rows read": [], "every row": []}
outputs: dict[str, list[int]] = {}
for r in range(rounds + 1):
    order = list(times) if r % 2 == 0 else list(times)[::-1]
    batch_prompts = [[rng.randrange(10, 40000) for _ in range(length)] for _ in range(prompts)]
    for name in order:
        batch_module.ForwardBatch.build = classmethod(every_row if name == "every row" else build)  # type: ignore
        for p in batch_prompts:
            engine.add_request(p, params)
        start = time.perf_counter()
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
        if r:  # round 0 warms up
            times[name].append(time.perf_counter() - start)
        outputs[name] = [o.outputs[0].token_ids[0] for o in sorted(done, key=lambda o: int(o.request_id))]
    assert outputs["rows read"] == outputs["every row"]
    if r:
        print(f"round {r}: " + ", ".join(f"{n} {times[n][-1]:.3f} s" for n in times), flush=True)
print("median: " + ", ".join(f"{n} {statistics.median(v):.3f} s" for n, v in times.items())
      + f"; every row / rows read {statistics.median(times['every row']) / statistics.median(times['rows read']):.4f}")
