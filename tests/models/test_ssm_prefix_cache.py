"""Prefix caching for state-space models (Mamba2, the Bamba, Granite 4.0 and Nemotron-H hybrids, LFM2): a hit restores
the mixers' state from a checkpoint saved where an earlier prompt left the cached tree
or at its last block boundary, and the attention layers' KV from the shared blocks.

Greedy tokens are compared with transformers' in float32 (one prompt at a time, its
own cache), so a restored state that differs in any layer shows as a wrong token;
the cached-token counts are worked out by hand from the block size; the books
(blocks, state slots, checkpoints) are checked after every step."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers_engine import run_arrivals, token_ids
from helpers_ssm import hf_greedy, ssm_engine, write_tiny_ssm_model

from kvloom import SamplingParams

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
BLOCK = 4
SHARED = [5 + (7 * i) % 50 for i in range(22)]  # 22 tokens: 5 whole blocks + 2


@pytest.fixture(scope="module", params=["bamba", "granite_hybrid", "lfm2", "lfm2_moe", "mamba2", "nemotron_h"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Bamba, Granite 4.0 (its experts, rotary and multipliers), LFM2 (short convolutions) and
    # LFM2-MoE: attention in layers 1 and 3 of 4.
    overrides = {"num_hidden_layers": 4, "attn_layer_indices": [1, 3]} if request.param == "bamba" else {}
    return write_tiny_ssm_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param, **overrides)


def test_hits_restore_the_state_and_match_transformers(model_dir: Path) -> None:
    prompts = {
        "a": SHARED + [60, 61, 62],  # 25 tokens: saves a checkpoint after 24 (its last block boundary)
        "b": SHARED + [70, 71, 72, 73],  # leaves the tree after 20 (5 blocks): saves one there, and after 24
        "c": SHARED + [80, 81],  # 24 tokens: hits b's 20 (its own last boundary, 20, is the same)
        "a_again": SHARED + [60, 61, 62],  # hits a's 24
    }
    reference = hf_greedy(model_dir, prompts, MAX_TOKENS)
    # The next turn of a's chat: its prompt, its answer and more; hits a's 24.
    prompts["a_turn2"] = prompts["a"] + reference["a"] + [90, 91]
    reference.update(hf_greedy(model_dir, {"a_turn2": prompts["a_turn2"]}, MAX_TOKENS))

    engine = ssm_engine(model_dir, block_size=BLOCK, num_blocks=256, max_num_batched_tokens=64)
    finals = {}
    for request_id, prompt in prompts.items():  # one after another: each sees the last one's cache
        finals.update(run_arrivals(engine, {0: [(request_id, prompt, GREEDY)]}))
    assert token_ids(finals) == reference
    cached = {request_id: output.num_cached_tokens for request_id, output in finals.items()}
    assert cached == {"a": 0, "b": 0, "c": 20, "a_again": 24, "a_turn2": 24}
    assert "checkpointed nowhere" in (finals["b"].cache_miss_reason or "")
    # a's 24, b's 20 and 24; c's last boundary is b's 20, which it hit; a_turn2's 28 and 32.
    assert engine.stats().num_cached_states == 5
    assert engine.state_pool.num_free_slots == engine.state_pool.num_slots


def test_checkpoints_are_evicted_least_recently_used_first(model_dir: Path) -> None:
    a, b, c = SHARED + [60, 61, 62], [9] * 13, [11] * 9  # checkpoints after 24, 12 and 8
    order = [("a", a), ("b", b), ("a_again", a), ("c", c), ("a_third", a), ("b_again", b)]
    reference = hf_greedy(model_dir, {"a": a, "b": b, "c": c}, MAX_TOKENS)
    engine = ssm_engine(model_dir, block_size=BLOCK, num_blocks=256, num_state_checkpoints=2)
    finals = {}
    for request_id, prompt in order:
        finals.update(run_arrivals(engine, {0: [(request_id, prompt, GREEDY)]}))
        assert finals[request_id].outputs[0].token_ids == reference[request_id.split("_")[0]]
    # Two slots: c's checkpoint evicts b's (a's was used since), b_again's evicts c's.
    cached = {request_id: output.num_cached_tokens for request_id, output in finals.items()}
    assert cached == {"a": 0, "b": 0, "a_again": 24, "c": 0, "a_third": 24, "b_again": 0}
    assert engine.stats().num_cached_states == 2


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_concurrent_sharers_and_preemption_match_transformers(model_dir: Path, overlap: str) -> None:
    """Also with overlap scheduling: a step's state copies and chunks are queued behind
    the previous step's, and a finished request's slot is reused only after it."""
    prompts = {f"r{i}": SHARED + [40 + i] * (i + 1) for i in range(6)}
    reference = hf_greedy(model_dir, prompts, MAX_TOKENS)
    # A pool too small for six at once: requests are preempted and recompute, hitting
    # the checkpoints the others saved; chunks of 5 cross checkpoints mid-chunk.
    engine = ssm_engine(model_dir, block_size=BLOCK, num_blocks=18, max_num_batched_tokens=12,
                        long_prefill_threshold=5, num_state_checkpoints=3, overlap_scheduling=overlap)
    arrivals = {0: [("r0", prompts["r0"], GREEDY)],
                3: [(rid, prompts[rid], GREEDY) for rid in ("r1", "r2", "r3")],
                9: [(rid, prompts[rid], GREEDY) for rid in ("r4", "r5")]}
    finals = run_arrivals(engine, arrivals)
    assert token_ids(finals) == reference
    # Those admitted after r1's checkpoint after the shared 20 tokens hit it.
    assert sorted(output.num_cached_tokens for output in finals.values())[-3:] == [20, 20, 20]
    assert engine.scheduler.num_preemptions > 0
    assert engine.state_pool.num_free_slots == engine.state_pool.num_slots


def test_no_checkpoints_turns_prefix_caching_off(model_dir: Path) -> None:
    engine = ssm_engine(model_dir, block_size=BLOCK, num_blocks=64, num_state_checkpoints=0)
    assert not engine.config.cache.enable_prefix_caching
    finals = run_arrivals(engine, {0: [("a", SHARED, GREEDY)], 8: [("b", SHARED, GREEDY)]})
    assert finals["b"].num_cached_tokens == 0
    assert token_ids(finals)["a"] == token_ids(finals)["b"] == hf_greedy(model_dir, {"a": SHARED}, MAX_TOKENS)["a"]
