"""Families that are Llama's layers under another name, each held to transformers in float32
(greedy tokens, first log-probs) and its bf16 walk near transformers' float32: Ministral
(Mistral's layers, windowed by config.json's layer_types, full layers between) and Seed-OSS
(q/k/v biases by attention_bias, the o projection's by its own attention_out_bias)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_models import assert_bf16_walk_near_float32, assert_greedy_is_transformers, write_tiny_hf_model

transformers = pytest.importorskip("transformers")

RNG = random.Random(47)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
VARIANTS = {
    "ministral": dict(sliding_window=20, layer_types=["sliding_attention", "full_attention"]),
    "seed_oss": dict(attention_bias=True, attention_out_bias=True),
}
EXPECTED = {"ministral": lambda c: c.full_attention_layers == (1,) and c.sliding_window == 20,
            "seed_oss": lambda c: c.attention_bias and c.attention_output_bias}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    path = write_tiny_hf_model(tmp_path_factory.mktemp(request.param), arch=request.param, seed=107, **SHAPE,
                               **VARIANTS[request.param])
    return request.param, path


def test_greedy_tokens_and_logprobs_are_transformers(variant: tuple[str, Path]) -> None:
    name, path = variant
    assert EXPECTED[name](assert_greedy_is_transformers(path, PROMPTS, 12).engine.model_config)


def test_bf16_native_walk_log_probs_are_transformers_float32s(variant: tuple[str, Path]) -> None:
    assert_bf16_walk_near_float32(variant[1], PROMPTS)
