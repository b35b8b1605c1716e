"""Kyutai's Helium: Llama's layers with RMSNorms scaled in float32 and a rotary of adjacent pairs
(regrouped at load for Llama's). Greedy tokens and first log-probs held to transformers in float32
(chunked, both attention backends, tensor parallel over two ranks), bf16 alone equal to batched
and chunked."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_engine import bf16_alone_equals_batched
from helpers_models import assert_bf16_walk_near_float32, assert_greedy_is_transformers, write_tiny_hf_model

from kvloom import SamplingParams

transformers = pytest.importorskip("transformers")

RNG = random.Random(18)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]


@pytest.fixture(scope="module")
def helium(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("helium"), arch="helium", seed=91, hidden_size=128,
                               intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
def test_greedy_tokens_and_logprobs_are_transformers(helium: Path, backend: str) -> None:
    llm = assert_greedy_is_transformers(helium, PROMPTS, 12, attention_backend=backend)
    assert llm.engine.model_config.interleaved_rotary


def test_two_ranks_give_transformers_greedy_tokens(helium: Path) -> None:
    """Each rank regroups its own heads' rows (the rotary's pairs stay within a head)."""
    assert_greedy_is_transformers(helium, PROMPTS[1:3], 8, tensor_parallel_size=2)


def test_bf16_tokens_alone_equal_batched_and_chunked(helium: Path) -> None:
    bf16_alone_equals_batched(str(helium), PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))


def test_bf16_native_walk_log_probs_are_transformers_float32s(helium: Path) -> None:
    """The walk with RMSNorms scaled in float32 (offset 0)."""
    assert_bf16_walk_near_float32(helium, PROMPTS)
