"""Sliding-window attention (Mistral, Phi-3, Qwen2's ``use_sliding_window``): each query
attends to its last ``sliding_window`` keys, in every layer or in those config.json's
``layer_types`` (Qwen2's ``max_window_layers``) mark. Contexts pass the window (they were
capped at it): greedy tokens and first log-probs held to transformers in float32 far past
the window (chunked, both attention backends, a prefix-cache hit), a model mixing
windowed and full layers, bf16 alone equal to batched and chunked in the native walk
(whose steps equal the modules' bit for bit: test_decoder_stack.py's mistral case)."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch
from helpers_engine import bf16_alone_equals_batched
from helpers_models import hf_greedy_and_first_logprobs as reference_run
from helpers_models import hf_greedy_batched, write_tiny_hf_model

from kvloom import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

WINDOW = 12
RNG = random.Random(12)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (5, 30, 47)]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0)
# head_dim 64: the paired layout, so bf16 runs the native walk.
SHAPE = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("mistral"), arch="mistral", seed=5, sliding_window=WINDOW,
                               **SHAPE)


@pytest.fixture(scope="module")
def references(mistral: Path) -> list[tuple[list[int], object]]:
    return [reference_run(mistral, prompt, GREEDY.max_tokens) for prompt in PROMPTS]


def test_the_window_changes_transformers_tokens(mistral: Path, references, tmp_path: Path) -> None:
    """What the tests below would miss were the window ignored: the same weights without
    one continue the longer prompts otherwise."""
    whole = write_tiny_hf_model(tmp_path / "whole", arch="mistral", seed=5, sliding_window=None, **SHAPE)
    assert [reference_run(whole, p, GREEDY.max_tokens)[0] for p in PROMPTS[1:]] != [r[0] for r in references[1:]]


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
def test_greedy_tokens_and_logprobs_are_transformers_past_the_window(mistral: Path, references, backend) -> None:
    llm = LLM(str(mistral), dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=16,
              attention_backend=backend)
    assert llm.engine.max_model_len == 512  # the model's positions, not its window
    assert [layer.self_attn.window for layer in llm.engine.model.layers] == [WINDOW, WINDOW]
    for output, (tokens, first) in zip(llm.generate(PROMPTS, GREEDY), references, strict=True):
        assert list(output.outputs[0].token_ids) == tokens
        assert output.outputs[0].logprobs[0][tokens[0]].logprob == pytest.approx(first[tokens[0]].item(), abs=1e-4)


def test_a_prefix_cache_hit_past_the_window_keeps_transformers_tokens(mistral: Path, references) -> None:
    llm = LLM(str(mistral), dtype="float32", block_size=16, num_blocks=64)
    llm.generate(PROMPTS[2][:40], GREEDY)  # caches two blocks of the longest prompt
    hit = llm.generate(PROMPTS[2], GREEDY)[0]
    assert llm.engine.scheduler.num_cached_prompt_tokens >= 32
    assert list(hit.outputs[0].token_ids) == references[2][0]


def test_layers_with_and_without_the_window_are_transformers(tmp_path: Path) -> None:
    """Qwen2 with use_sliding_window and max_window_layers 1: layer 0 attends to the whole
    context, layer 1 to its window (transformers' layer_types)."""
    path = write_tiny_hf_model(tmp_path / "qwen2", arch="qwen2", seed=6, sliding_window=WINDOW,
                               use_sliding_window=True, max_window_layers=1, **SHAPE)
    llm = LLM(str(path), dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=16)
    assert [layer.self_attn.window for layer in llm.engine.model.layers] == [0, WINDOW]
    outputs = llm.generate(PROMPTS[1:], GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [reference_run(path, p, 20)[0] for p in PROMPTS[1:]]


def test_a_window_no_context_reaches_masks_nothing(mistral: Path) -> None:
    """Served no longer than the window, the layers attend to whole contexts (the kernel's
    shared walks over cached prefixes stay on)."""
    llm = LLM(str(mistral), dtype="float32", block_size=16, num_blocks=64, max_model_len=WINDOW)
    assert [layer.self_attn.window for layer in llm.engine.model.layers] == [0, 0]


def test_bf16_tokens_alone_equal_batched_and_chunked(mistral: Path) -> None:
    together = bf16_alone_equals_batched(str(mistral), PROMPTS, SamplingParams(max_tokens=16, temperature=0.0,
                                                                               ignore_eos=True))
    assert together.model.native_stack is not None  # the walk attends within each layer's window



def run_checked(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], int]:
    """The requests' tokens, the integrity of every block count checked after each step,
    and the most blocks one running request held."""
    from kvloom.request import NO_BLOCK

    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"r{index}")
    tokens: dict[str, list[int]] = {}
    most_held = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] = list(output.outputs[0].token_ids)
        engine.check_integrity()  # every let-go entry leads its table, none is one its window reads
        for request in engine.scheduler.running:
            held = engine.kv_manager.num_held_blocks(request)
            most_held = max(most_held, held)
            assert request.block_ids.count(NO_BLOCK) == len(request.block_ids) - held
    return [tokens[f"r{index}"] for index in range(len(prompts))], most_held


def test_long_generations_hold_their_windows_not_their_sequences(mistral: Path, tmp_path: Path) -> None:
    """Under the window every request lets go of the blocks it has passed: three requests
    of up to 47 + 120 tokens (11 blocks of 16 each) run together in a pool of 10 blocks and
    keep transformers' greedy tokens, each holding at most 3 blocks (12 keys span at most
    2, and the block being written); the same weights without a window are refused that pool."""
    from kvloom.engine.engine import EngineConfig, LLMEngine

    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(EngineConfig.from_kwargs(str(mistral), dtype="float32", block_size=16, num_blocks=10,
                                                max_num_batched_tokens=16))
    assert engine.kv_manager.window == WINDOW
    tokens, most_held = run_checked(engine, PROMPTS, params)
    assert tokens == long_references(mistral, tuple(tuple(p) for p in PROMPTS))
    assert most_held == 3 and engine.scheduler.num_preemptions == 0
    # A request of n tokens has let go of (n - 1 + 1 - 12) // 16 blocks by its last step:
    # 125 tokens 7, 150 tokens 8, 167 tokens 9.
    assert engine.kv_manager.num_window_freed_blocks == engine.stats().num_window_freed_blocks == 7 + 8 + 9
    from kvloom.server.metrics import EngineMetrics
    metrics = EngineMetrics()
    metrics.record_state(engine.stats())
    assert metrics.registry.get_sample_value("kvloom:num_window_freed_blocks_total") == 24
    whole = write_tiny_hf_model(tmp_path / "whole", arch="mistral", seed=5, sliding_window=None, **SHAPE)
    plain = LLMEngine(EngineConfig.from_kwargs(str(whole), dtype="float32", block_size=16, num_blocks=10,
                                               max_num_batched_tokens=16))
    with pytest.raises(ValueError, match="needs 11 KV blocks, but the whole pool has 10"):
        plain.add_request(PROMPTS[2], params)
    # Nor is the window counted where prompts are not chunked: a preempted request's
    # recomputation then takes its whole sequence in one step.
    unchunked = LLMEngine(EngineConfig.from_kwargs(str(mistral), dtype="float32", block_size=16, num_blocks=10,
                                                   enable_chunked_prefill=False))
    with pytest.raises(ValueError, match="needs 11 KV blocks, but the whole pool has 10"):
        unchunked.add_request(PROMPTS[2], params)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_preempted_requests_recompute_under_the_window(mistral: Path, overlap: str) -> None:
    """Four such requests in 7 blocks: preempted and recomputed over and over (a recompute
    lets go of blocks as its chunks pass them), their tokens still transformers'; with
    overlap scheduling too, where a block is let go while the step before may read it."""
    from kvloom.engine.engine import EngineConfig, LLMEngine

    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    prompts = [PROMPTS[index % 3] + [index] for index in range(4)]
    engine = LLMEngine(EngineConfig.from_kwargs(str(mistral), dtype="float32", block_size=16, num_blocks=7,
                                                max_num_batched_tokens=16, overlap_scheduling=overlap))
    tokens, most_held = run_checked(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert most_held <= engine.limits.blocks_held_at_most(48, 120) == 7
    assert tokens == long_references(mistral, tuple(tuple(p) for p in prompts))


@functools.cache
def long_references(path: Path, prompts: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    """transformers' 120 greedy tokens of each prompt, in one left-padded batch."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf_greedy_batched(model, [list(prompt) for prompt in prompts], 120)


def test_speculation_under_the_window_keeps_the_tokens(mistral: Path, references) -> None:
    """Prompt-lookup drafts verified past the window, with blocks let go while drafts
    are rolled back, in a pool too small for the whole sequences: transformers' tokens."""
    llm = LLM(str(mistral), dtype="float32", block_size=16, num_blocks=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [r[0] for r in references]
    assert llm.engine.scheduler.num_draft_tokens > 0 and llm.engine.kv_manager.num_window_freed_blocks > 0
    llm.engine.check_integrity()
