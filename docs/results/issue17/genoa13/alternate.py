"""The harness of this session's A/B scripts (kv_order_steps.py, delay_steps.py, single_fetch.py,
split_from.py, genoa15/amx_walks.py): the default model (or $MODEL) in bf16 with a batch of sequences all decoding, then decode
steps under each setting in turn, the settings alternating (both orders, round by round) in one
process, reported as median and min ms a step. A script that needs a patched build (a worktree
with fetch_order_and_offset_tried.patch applied) runs with that worktree on PYTHONPATH and says
so through `worktree`."""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable

import kvloom
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.models.default_model import resolve_default_model
from kvloom.sampling_params import SamplingParams

STEPS_PER_SETTING = 5  # timed steps each time a setting comes round (after one untimed)


def worktree(path: str) -> None:
    """Stop unless kvloom is imported from `path` (the patched build the script drives)."""
    assert path in kvloom.__file__, f"run with PYTHONPATH={path} (kvloom is {kvloom.__file__})"


def decoding_engine(prompt_lengths: list[int], rounds: int, num_settings: int) -> LLMEngine:
    """An engine whose sequences (a random prompt of each length) all decode, with tokens left
    for `rounds` of every setting."""
    steps = rounds * num_settings * (STEPS_PER_SETTING + 1)
    blocks = sum(length + steps + 80 for length in prompt_lengths) // 16 + 200
    model = os.environ.get("MODEL") or str(resolve_default_model())  # MODEL: another checkpoint's folder
    engine = LLMEngine(EngineConfig.from_kwargs(model, dtype="bfloat16",
                                                enable_prefix_caching=False, max_num_seqs=256, num_blocks=blocks))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + 60, temperature=0.0, ignore_eos=True)
    for length in prompt_lengths:
        engine.add_request([rng.randrange(10, 40000) for _ in range(length)], params)
    started: set[str] = set()
    while len(started) < len(prompt_lengths):  # every prompt prefilled: the timed steps are pure decodes
        started.update(output.request_id for output in engine.step() if output.outputs[0].token_ids)
    for _ in range(3):
        engine.step()
    return engine


def alternate(engine: LLMEngine, settings: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each timed step, by setting; `settings` maps a name to what applies it."""
    times: dict[str, list[float]] = {name: [] for name in settings}
    order = list(settings)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            settings[name]()
            engine.step()
            for _ in range(STEPS_PER_SETTING):
                start = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - start)
    return times


def report(label: str, times: dict[str, list[float]]) -> None:
    for name, values in times.items():
        print(f"{label} {name}: median {statistics.median(values) * 1e3:7.2f} ms min {min(values) * 1e3:7.2f}")
