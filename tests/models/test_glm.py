"""Zhipu's GLM-4 (GlmForCausalLM) and GLM-4-0414 (Glm4ForCausalLM): Llama's layers with q/k/v
biases, fused gate/up in the checkpoint and a rotary that turns adjacent pairs of the first half
of each head; GLM-4-0414 norms each block's output before adding it (Gemma 2's sandwich in
RMSNorms). Greedy tokens and first log-probs held to transformers in float32, the native walk in
bf16 near transformers' float32, a LoRA adapter held to PEFT (its q/k rows regrouped as the
weights': the rotary part only)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_models import assert_bf16_walk_near_float32, assert_greedy_is_transformers, write_tiny_hf_model

transformers = pytest.importorskip("transformers")

RNG = random.Random(31)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


@pytest.fixture(scope="module", params=["glm", "glm4"])
def glm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp(request.param), arch=request.param, seed=91, **SHAPE)


def test_greedy_tokens_and_logprobs_are_transformers(glm: Path) -> None:
    config = assert_greedy_is_transformers(glm, PROMPTS, 12).engine.model_config
    assert (config.interleaved_rotary, config.rotary_dim, config.attention_bias) == (True, 16, True)


def test_bf16_native_walk_log_probs_are_transformers_float32s(glm: Path) -> None:
    assert_bf16_walk_near_float32(glm, PROMPTS)


def test_a_lora_adapter_is_peft(glm: Path, tmp_path: Path) -> None:
    from helpers_lora import FAMILY_TARGETS, assert_adapter_is_peft

    assert_adapter_is_peft(glm, tmp_path / "adapter", PROMPTS[2:], FAMILY_TARGETS["glm"][0])


@pytest.mark.parametrize("kind", ["tensor", "array"])
def test_the_regroup_moves_the_turned_rows_of_each_head_only(kind: str) -> None:
    """Two heads of 6 rows, the first 4 turned: pairs (0, 1), (2, 3) become halves (0, 2 | 1, 3);
    rows 4 and 5 stay. By hand: head h's rows h6+0, h6+2, h6+1, h6+3, h6+4, h6+5."""
    import numpy as np
    import torch

    from kvloom.models.weights import halves_from_pairs

    rows = torch.arange(12.0).reshape(12, 1)
    source = rows if kind == "tensor" else rows.numpy()
    moved = halves_from_pairs(source, 2, 4)
    expected = [0, 2, 1, 3, 4, 5, 6, 8, 7, 9, 10, 11]
    assert np.asarray(moved).reshape(-1).tolist() == expected
    assert np.asarray(halves_from_pairs(source, 2)).reshape(-1).tolist() == [0, 2, 4, 1, 3, 5, 6, 8, 10, 7, 9, 11]


def test_two_ranks_give_transformers_greedy_tokens(glm: Path) -> None:
    """Each rank regroups its own heads' turned rows; GLM-4-0414's block norms are whole on each."""
    assert_greedy_is_transformers(glm, PROMPTS[1:3], 6, tensor_parallel_size=2)
