"""Where an offline run's time goes, step by step: `kvloom bench offline`'s run (the same
engine settings as results/run_vs_openvino.sh) with a timer around each engine step,
summed by kind: steps that compute prompt tokens (prefill chunks, with the decodes that
ride along; "2,048" where the step's token budget was full) and pure decode steps by
batch size.

    .venv/bin/python docs/results/issue17/offline_steps.py WORKLOAD.jsonl NUM_PROMPTS [LEAD] [MODEL_DIR]

WORKLOAD is shared/peers/make_ov_workload.py's token-id JSONL (e.g.
~/kvloom-peers/workloads/sharegpt200.jsonl 200, or prefix100.jsonl 100 1). SPEC='{"method": "ngram", ...}'
in the environment runs the engine with that speculative config; FINE=1 lists the decode steps
of 1-24 sequences by batch size.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

from kvloom.batch import SchedulerOutput
from kvloom.bench import datasets
from kvloom.bench.offline import run_offline, warm_up
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine


def main() -> None:
    path, num_prompts = sys.argv[1], int(sys.argv[2])
    lead = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    model = sys.argv[4] if len(sys.argv) > 4 else str(Path.home() / "kvloom-peers/models/smollm2-135m-instruct")
    spec = json.loads(os.environ["SPEC"]) if os.environ.get("SPEC") else None
    fine = os.environ.get("FINE") == "1"
    engine = LLMEngine(EngineConfig.from_kwargs(model, dtype="bfloat16", kv_cache_memory=4, max_num_seqs=256,
                                                speculative_config=spec))
    requests = datasets.load_token_workload(path, num_prompts)
    warm_up(engine)
    steps: list[tuple[float, int, int]] = []  # seconds, prompt tokens computed, decodes
    schedule, step = engine.scheduler.schedule, engine.step
    scheduled: list[SchedulerOutput] = []

    def recorded_schedule() -> SchedulerOutput:
        scheduled.append(schedule())
        return scheduled[-1]

    def timed_step():  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        outputs = step()
        batch = scheduled.pop()
        prompt = sum(s.num_new_tokens for s in batch.scheduled if s.is_prefill)
        steps.append((time.perf_counter() - start, prompt, sum(not s.is_prefill for s in batch.scheduled)))
        return outputs

    engine.scheduler.schedule = recorded_schedule  # type: ignore[method-assign]
    engine.step = timed_step  # type: ignore[method-assign]
    result = run_offline(engine, requests, "continuous", lead=lead, show_progress=False)
    print(f"{result.output_tokens} output tokens in {result.elapsed_s:.1f} s ({result.output_throughput:.1f} tok/s), "
          f"{len(steps)} steps")
    kinds: dict[tuple[int, str], list[float]] = defaultdict(list)  # (order, label) -> step times
    for seconds, prompt, decodes in steps:
        if prompt:
            kinds[(0, "with 2,048 prompt tokens" if prompt + decodes == 2048 else "with fewer")].append(seconds)
        else:
            if fine and decodes < 25:  # the tail's batch sizes one by one
                kinds[(1 + decodes, f"decode, batch {decodes}")].append(seconds)
                continue
            low = min(decodes // 25 * 25, 150)
            kinds[(1 + low, f"decode, batch {max(low, 1)}-{low + 24 if low < 150 else 256}")].append(seconds)
    print(f"{'steps':<30}{'count':>7}{'seconds':>9}{'ms each':>9}")
    for order, label in sorted(kinds):
        times = kinds[(order, label)]
        print(f"{label:<30}{len(times):>7}{sum(times):>9.1f}{sum(times) / len(times) * 1e3:>9.1f}")

if __name__ == "__main__":
    main()
