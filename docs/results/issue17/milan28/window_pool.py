"""Long generations of a sliding-window model in a pool too small for their whole
sequences: the default model (SmolLM2-135M, bf16) given a window in every layer
(``hf_overrides``), requests of 128 random prompt tokens and greedy output tokens
(``ignore_eos``) in a pool of blocks of 16, all submitted at once. The arguments: requests,
output tokens, window, blocks (default 32 512 256 160: 2,560 tokens, four whole sequences
of 640). Run from a tree on PYTHONPATH, so that the tree before a change and the tree
after it can be timed alternately in fresh processes:

    PYTHONPATH=. .venv/bin/python docs/results/issue17/milan28/window_pool.py 16 1024 128 320
    PYTHONPATH=/tmp/before .venv/bin/python docs/results/issue17/milan28/window_pool.py 16 1024 128 320

Prints output tokens/s, the mean requests per step, the most KV blocks the running
requests held at once, preemptions and the blocks let go behind the window."""

from __future__ import annotations

import random
import sys
import time

import kvloom
from kvloom import SamplingParams
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.models.default_model import resolve_default_model

PROMPT = 128
REQUESTS, OUTPUT, WINDOW, BLOCKS = (int(a) for a in (sys.argv[1:] or ["32", "512", "256", "160"]))


def main() -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(str(resolve_default_model()), dtype="bfloat16", block_size=16,
                                                num_blocks=BLOCKS, hf_overrides={"sliding_window": WINDOW}))
    kv = engine.kv_manager
    rng = random.Random(0)
    params = SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True)
    engine.add_request([1] * 64, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up, untimed
    while engine.has_unfinished_requests():
        engine.step()
    for index in range(REQUESTS):
        engine.add_request([rng.randrange(3, 49000) for _ in range(PROMPT)], params, request_id=f"r{index}")
    steps = batch = most_held = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        steps += 1
        batch += len(running)
        held = getattr(kv, "num_held_blocks", lambda r: len(r.block_ids))
        most_held = max(most_held, sum(held(r) for r in running))
    seconds = time.perf_counter() - start
    print(f"{kvloom.__file__}: {REQUESTS * OUTPUT / seconds:.1f} tok/s ({seconds:.1f} s), {steps} steps, "
          f"{batch / steps:.1f} requests a step, at most {most_held} blocks held by running requests, "
          f"{engine.scheduler.num_preemptions} preemptions, "
          f"{getattr(kv, 'num_window_freed_blocks', 0)} blocks let go behind the window")


if __name__ == "__main__":
    main()
