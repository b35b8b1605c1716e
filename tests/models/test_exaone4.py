"""LG AI's EXAONE 4.0: OLMo 2's post-block norms with Llama's RMSNorms and per-head q/k norms, three
sliding-window layers in four with the rotary, global layers without position encoding. Greedy tokens
and first log-probs held to transformers in float32 past the window (chunked, both attention
backends), with and without a window; bf16 alone equal to batched and chunked; two ranks refused."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_engine import bf16_alone_equals_batched
from helpers_models import assert_bf16_walk_near_float32, assert_greedy_is_transformers, write_tiny_hf_model

from kvloom import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

RNG = random.Random(17)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=4, head_dim=32)


@pytest.fixture(scope="module")
def exaone4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layers 0-2 windowed at 12 keys (the prompts pass it), layer 3 global and without rotary."""
    return write_tiny_hf_model(tmp_path_factory.mktemp("exaone4"), arch="exaone4", seed=81, sliding_window=12,
                               sliding_window_pattern=4, **SHAPE)


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
def test_greedy_tokens_and_logprobs_are_transformers(exaone4: Path, backend: str) -> None:
    llm = assert_greedy_is_transformers(exaone4, PROMPTS, 12, attention_backend=backend)
    config = llm.engine.model_config
    assert (config.no_rope_layers, config.full_attention_layers, config.qk_norm) == ((3,), (3,), True)
    assert [layer.self_attn.window for layer in llm.engine.model.layers] == [12, 12, 12, 0]


def test_bf16_native_walk_log_probs_are_transformers_float32s(exaone4: Path) -> None:
    """The walk with OLMo 2's layer, Llama's norms, q/k norms of a head and a global layer
    without rotary."""
    assert_bf16_walk_near_float32(exaone4, PROMPTS)


def test_without_a_window_every_layer_turns_the_rotary(tmp_path: Path) -> None:
    # (layer_types given: transformers' own default divides by the pattern, 0 without a window)
    path = write_tiny_hf_model(tmp_path / "exaone4-global", arch="exaone4", seed=82, sliding_window=None,
                               layer_types=["full_attention"] * 4, **SHAPE)
    assert assert_greedy_is_transformers(path, PROMPTS, 12).engine.model_config.no_rope_layers == ()


def test_bf16_tokens_alone_equal_batched_and_chunked(exaone4: Path) -> None:
    bf16_alone_equals_batched(str(exaone4), PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))


def test_two_ranks_give_transformers_greedy_tokens(exaone4: Path) -> None:
    """Its q/k norms are of a head (each rank's heads'); the block norms act on all-reduced rows."""
    assert_greedy_is_transformers(exaone4, PROMPTS[1:3], 6, tensor_parallel_size=2)


def test_a_gguf_file_gives_transformers_greedy_tokens(exaone4: Path, tmp_path: Path) -> None:
    """llama.cpp's exaone4 files: the window and a per-layer pattern as metadata, post-block norms
    as OLMo 2's, the global layers read as NoPE."""
    from helpers_models import hf_greedy_and_first_logprobs as reference_run
    from helpers_models import write_tiny_gguf

    llm = LLM(str(write_tiny_gguf(exaone4, tmp_path / "exaone4.gguf")), dtype="float32", block_size=16,
              num_blocks=64)
    assert llm.engine.model_config.no_rope_layers == (3,)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, greedy)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [reference_run(exaone4, p, 12)[0] for p in PROMPTS]
