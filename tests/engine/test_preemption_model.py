"""Preemption and chunking on a tiny real model: outputs equal an unconstrained run."""

from __future__ import annotations

import random

import pytest

from kvloom import SamplingParams
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine


def run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for request_id, prompt in prompts.items():
        engine.add_request(prompt, params, request_id=request_id)
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
        engine.check_integrity()
    return results


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    rng = random.Random(3)
    return {f"r{i}": [rng.randrange(3, 512) for _ in range(rng.randrange(20, 60))] for i in range(20)}


@pytest.mark.parametrize("prefix_cache", [False, True])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_memory_pressure_preempts_and_keeps_outputs(tiny_llama, prompts, prefix_cache, sampling) -> None:
    params = (SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True) if sampling == "greedy"
              else SamplingParams(max_tokens=40, temperature=0.8, seed=11, ignore_eos=True))

    def engine(**kwargs) -> LLMEngine:
        return LLMEngine(EngineConfig.from_kwargs(str(tiny_llama), dtype="float32", block_size=8,
                                                  enable_prefix_caching=prefix_cache, **kwargs))

    reference = run(engine(num_blocks=1024), prompts, params)
    # 30 blocks x 8 tokens hold about three requests of ~80 tokens.
    constrained = engine(num_blocks=30, trace=True)
    results = run(constrained, prompts, params)
    assert results == reference
    assert constrained.scheduler.num_preemptions > 0
    assert any(record.preempted for record in constrained.scheduler.trace.records)
    assert constrained.kv_manager.num_available_blocks == 30


def test_chunked_and_unchunked_prefill_agree(tiny_llama, prompts) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def engine(**kwargs) -> LLMEngine:
        return LLMEngine(EngineConfig.from_kwargs(str(tiny_llama), dtype="float32", num_blocks=512,
                                                  enable_prefix_caching=False, **kwargs))

    chunked = run(engine(max_num_batched_tokens=16, long_prefill_threshold=8), prompts, params)
    unchunked = run(engine(enable_chunked_prefill=False), prompts, params)
    assert chunked == unchunked
