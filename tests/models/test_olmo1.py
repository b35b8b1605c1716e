"""AllenAI's OLMo 1: Llama's layers with LayerNorms without weights, and clip_qkv. Greedy tokens
and first log-probs held to transformers in float32 (chunked, both attention backends, with a clip
that bites and without one), bf16 alone equal to batched and chunked."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_engine import bf16_alone_equals_batched
from helpers_models import assert_bf16_walk_near_float32, assert_greedy_is_transformers, write_tiny_hf_model

from kvloom import SamplingParams

transformers = pytest.importorskip("transformers")

RNG = random.Random(19)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4)


@pytest.fixture(scope="module")
def olmo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """clip_qkv 0.05: about the projections' spread on these random weights, so it clamps some."""
    return write_tiny_hf_model(tmp_path_factory.mktemp("olmo"), arch="olmo", seed=101, clip_qkv=0.05, **SHAPE)


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
def test_greedy_tokens_and_logprobs_are_transformers(olmo: Path, backend: str) -> None:
    llm = assert_greedy_is_transformers(olmo, PROMPTS, 12, attention_backend=backend)
    assert llm.engine.model_config.clip_qkv == 0.05


def test_without_a_clip(tmp_path: Path) -> None:
    path = write_tiny_hf_model(tmp_path / "olmo-unclipped", arch="olmo", seed=102, **SHAPE)
    assert assert_greedy_is_transformers(path, PROMPTS, 12).engine.model_config.clip_qkv is None


def test_bf16_native_walk_log_probs_are_transformers_float32s(olmo: Path) -> None:
    """The walk with LayerNorms of weight 1 and bias 0 and the clip after the projection."""
    assert_bf16_walk_near_float32(olmo, PROMPTS)


def test_bf16_tokens_alone_equal_batched_and_chunked(olmo: Path) -> None:
    bf16_alone_equals_batched(str(olmo), PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))


def test_a_gguf_file_gives_transformers_greedy_tokens(olmo: Path, tmp_path: Path) -> None:
    """llama.cpp's olmo files: no norm tensors, Q/K rows permuted as Llama's, the clip as
    attention.clamp_kqv."""
    from helpers_models import hf_greedy_and_first_logprobs as reference_run
    from helpers_models import write_tiny_gguf

    from kvloom import LLM

    llm = LLM(str(write_tiny_gguf(olmo, tmp_path / "olmo.gguf")), dtype="float32", block_size=16, num_blocks=64)
    assert (llm.engine.model_config.architecture, llm.engine.model_config.clip_qkv) == ("OlmoForCausalLM", 0.05)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, greedy)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [reference_run(olmo, p, 12)[0] for p in PROMPTS]
