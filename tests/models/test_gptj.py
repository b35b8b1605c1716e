"""EleutherAI's GPT-J: Phi's side-by-side layer on one LayerNorm with bias-free attention
projections, a gelu_new MLP with biases, an adjacent-pair rotary on each head's first
rotary_dim dimensions, an output head with a bias. Greedy tokens and first log-probs held to
transformers in float32 (tied and untied), the native walk in bf16 near transformers' float32,
a LoRA adapter held to PEFT (q/k rows of the turned part regrouped); old checkpoints' saved
masks skipped; two ranks refused by name."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_models import assert_bf16_walk_near_float32, assert_greedy_is_transformers, write_tiny_hf_model

transformers = pytest.importorskip("transformers")

RNG = random.Random(43)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
SHAPE = dict(hidden_size=128, num_attention_heads=4, n_inner=256, rotary_dim=16, max_position_embeddings=128)


@pytest.fixture(scope="module")
def gptj(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("gptj"), arch="gptj", seed=103, **SHAPE)


def test_greedy_tokens_and_logprobs_are_transformers(gptj: Path) -> None:
    config = assert_greedy_is_transformers(gptj, PROMPTS, 12).engine.model_config
    assert (config.rotary_dim, config.interleaved_rotary, config.attention_bias, config.mlp_bias) == \
        (16, True, False, True)
    assert not config.tie_word_embeddings


def test_bf16_native_walk_log_probs_are_transformers_float32s(gptj: Path) -> None:
    assert_bf16_walk_near_float32(gptj, PROMPTS)


def test_saved_masks_beside_the_weights_are_skipped_and_a_lora_adapter_is_peft(gptj: Path, tmp_path: Path) -> None:
    from helpers_lora import FAMILY_TARGETS, assert_adapter_is_peft
    from helpers_models import with_saved_masks

    assert_greedy_is_transformers(with_saved_masks(gptj, tmp_path / "gptj-masks"), PROMPTS[1:3], 6)
    assert_adapter_is_peft(gptj, tmp_path / "adapter", PROMPTS[2:], FAMILY_TARGETS["gptj"][0])


def test_two_ranks_give_transformers_greedy_tokens(gptj: Path) -> None:
    """fc_in / fc_out cut as fc1 / fc2; the head's bias with its rows."""
    assert_greedy_is_transformers(gptj, PROMPTS[1:3], 6, tensor_parallel_size=2)
