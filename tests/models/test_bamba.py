"""Bamba (Mamba2 mixers + attention layers over the paged KV pool) on the engine:
greedy tokens identical to transformers in float32 through chunked prefill, batching,
state-slot waits and preemption (both the KV blocks and the state slots of preempted
requests come back), the books checked after every step; the KV pool holds only the
attention layers."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers_engine import run_arrivals, token_ids
from helpers_ssm import hf_greedy, random_prompts, ssm_engine, write_tiny_ssm_model

from kvloom import SamplingParams
from kvloom.engine.trace import WaitReason

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Four layers, attention at 1 and 3: the pool's layers are 0 and 1.
    return write_tiny_ssm_model(tmp_path_factory.mktemp("tiny-bamba"), "bamba", num_hidden_layers=4,
                                attn_layer_indices=[1, 3], tie_word_embeddings=request.param)


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    return random_prompts(6, seed=7)


@pytest.fixture(scope="module")
def reference(model_dir: Path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    return hf_greedy(model_dir, prompts, MAX_TOKENS)


def staggered(prompts: dict[str, list[int]]) -> dict[int, list[tuple[str, list[int], SamplingParams]]]:
    arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
    for i, (request_id, prompt) in enumerate(prompts.items()):
        arrivals.setdefault(0 if i < 2 else 2 * i, []).append((request_id, prompt, GREEDY))
    return arrivals


@pytest.mark.parametrize("backend", ["auto", "torch_ref"])
def test_chunked_prefill_and_batching_match_transformers(model_dir, prompts, reference, backend) -> None:
    engine = ssm_engine(model_dir, max_num_batched_tokens=16, long_prefill_threshold=5, block_size=4,
                        num_blocks=256, attention_backend=backend)
    finals = run_arrivals(engine, staggered(prompts))
    assert token_ids(finals) == reference
    assert any(len(output.metrics.prefill_chunks) > 1 for output in finals.values())
    assert engine.runner.kv_caches.shape[:3] == (2, 2, 256)  # the two attention layers' K and V
    assert engine.state_pool.num_free_slots == engine.state_pool.num_slots


def test_requests_wait_for_a_state_slot(model_dir, prompts, reference) -> None:
    engine = ssm_engine(model_dir, num_state_slots=3, max_num_seqs=8, num_blocks=256, trace=True)
    finals = run_arrivals(engine, {0: [(rid, prompt, GREEDY) for rid, prompt in prompts.items()]})
    assert token_ids(finals) == reference
    records = engine.scheduler.trace.records
    assert max(len(record.scheduled) for record in records) == 3
    assert any(reason == WaitReason.NO_FREE_STATE_SLOT.value for record in records for _, reason in record.waiting)


def test_preempted_requests_recompute_from_a_zero_state(model_dir, prompts, reference) -> None:
    engine = ssm_engine(model_dir, num_blocks=20, block_size=4, max_num_batched_tokens=24)
    finals = run_arrivals(engine, staggered(prompts))
    assert engine.scheduler.num_preemptions > 0
    assert token_ids(finals) == reference
    assert engine.kv_manager.num_available_blocks == 20
    assert engine.state_pool.num_free_slots == engine.state_pool.num_slots


def test_refusals_name_the_reason(model_dir) -> None:
    with pytest.raises(ValueError, match="speculative decoding is not supported for state-space models"):
        ssm_engine(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 is not supported for state-space"):
        ssm_engine(model_dir, tensor_parallel_size=2)
