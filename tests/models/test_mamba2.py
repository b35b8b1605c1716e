"""Mamba2 (a pure state-space model) on the engine: greedy tokens identical to
transformers in float32 through chunked prefill, batching, state-slot waits and
preemption, the state pool's books checked after every step; what the engine refuses
or turns off for it."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers_engine import run_arrivals, token_ids
from helpers_ssm import hf_greedy, random_prompts, ssm_engine, write_tiny_ssm_model

from kvloom import SamplingParams
from kvloom.cache.prefix_cache import NoPrefixCache
from kvloom.engine.trace import WaitReason
from kvloom.models.mamba2 import Mamba2Mixer

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_ssm_model(tmp_path_factory.mktemp("tiny-mamba2"), "mamba2")


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    return random_prompts(6, seed=5)


@pytest.fixture(scope="module")
def reference(model_dir: Path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    return hf_greedy(model_dir, prompts, MAX_TOKENS)


def staggered(prompts: dict[str, list[int]]) -> dict[int, list[tuple[str, list[int], SamplingParams]]]:
    """Two requests at once, the others joining while those decode."""
    arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
    for i, (request_id, prompt) in enumerate(prompts.items()):
        arrivals.setdefault(0 if i < 2 else 2 * i, []).append((request_id, prompt, GREEDY))
    return arrivals


@pytest.mark.parametrize("prefill_scan", ["native", "ssd", "sequential"])
def test_chunked_prefill_and_batching_match_transformers(model_dir, prompts, reference, prefill_scan) -> None:
    # 16 tokens a step, chunks of at most 8: every prompt over 8 tokens is split, and
    # decodes share steps with other requests' chunks.
    engine = ssm_engine(model_dir, max_num_batched_tokens=16, long_prefill_threshold=6, block_size=4)
    for module in engine.model.modules():
        if isinstance(module, Mamba2Mixer):
            module.prefill_scan = prefill_scan
    finals = run_arrivals(engine, staggered(prompts))
    assert token_ids(finals) == reference
    assert any(len(output.metrics.prefill_chunks) > 1 for output in finals.values())
    assert engine.runner.kv_caches.shape[0] == 0  # no attention layer: blocks are bookkeeping
    assert engine.state_pool.num_free_slots == engine.state_pool.num_slots


def test_requests_wait_for_a_state_slot(model_dir, prompts, reference) -> None:
    engine = ssm_engine(model_dir, num_state_slots=2, max_num_seqs=8, max_num_batched_tokens=32, trace=True)
    finals = run_arrivals(engine, {0: [(rid, prompt, GREEDY) for rid, prompt in prompts.items()]})
    assert token_ids(finals) == reference
    records = engine.scheduler.trace.records
    assert max(len(record.scheduled) for record in records) == 2
    assert any(reason == WaitReason.NO_FREE_STATE_SLOT.value for record in records for _, reason in record.waiting)


def test_preempted_requests_recompute_from_a_zero_state(model_dir, prompts, reference) -> None:
    # 20 blocks of 4 tokens hold about two requests of ~45 tokens: the rest preempt.
    engine = ssm_engine(model_dir, num_blocks=20, block_size=4, max_num_batched_tokens=24)
    finals = run_arrivals(engine, staggered(prompts))
    assert engine.scheduler.num_preemptions > 0
    assert token_ids(finals) == reference
    assert engine.state_pool.num_free_slots == engine.state_pool.num_slots


def test_prefix_caching_is_off_without_state_checkpoints(model_dir, prompts) -> None:
    # (With checkpoints, the default: tests/models/test_ssm_prefix_cache.py.)
    engine = ssm_engine(model_dir, num_state_checkpoints=0)
    assert not engine.config.cache.enable_prefix_caching
    assert isinstance(engine.kv_manager.prefix_cache, NoPrefixCache)
    prompt = prompts["r0"] * 3
    first = run_arrivals(engine, {0: [("a", prompt, GREEDY)]})
    again = run_arrivals(engine, {0: [("b", prompt, GREEDY)]})
    assert token_ids(again)["b"] == token_ids(first)["a"]
    assert engine.stats().prefix_cache_hit_tokens == 0


@pytest.mark.parametrize("options, reason", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative decoding"),
    ({"role": "prefill"}, "disaggregation"),
    ({"role": "decode"}, "disaggregation"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
])
def test_the_engine_refuses_what_the_state_cannot_follow(model_dir, options, reason) -> None:
    with pytest.raises(ValueError, match=reason) as error:
        ssm_engine(model_dir, **options)
    assert "Mamba2ForCausalLM keeps a state per request" in str(error.value)


def test_the_state_slots_are_reported(model_dir, prompts) -> None:
    """EngineStats and the server's gauge: slots held by running requests, then none."""
    from kvloom.server.metrics import EngineMetrics
    engine = ssm_engine(model_dir, num_state_slots=3, max_num_seqs=8)
    for prompt in list(prompts.values())[:2]:
        engine.add_request(prompt, GREEDY)
    engine.step()
    stats = engine.stats()
    assert (stats.num_state_slots, stats.num_free_state_slots) == (3, 3 - stats.num_running) and stats.num_running == 2
    metrics = EngineMetrics()
    metrics.record_state(stats)
    assert metrics.registry.get_sample_value("kvloom:state_slots_usage_perc") == pytest.approx(2 / 3)
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert stats.num_free_state_slots == 3
    # Each prompt (no two share a block) saved its state after its last whole block of 16, if any.
    assert stats.num_cached_states == sum(len(p) > 16 for p in list(prompts.values())[:2]) > 0
    metrics.record_state(stats)
    assert metrics.registry.get_sample_value("kvloom:num_cached_states") == stats.num_cached_states
