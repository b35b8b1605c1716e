"""Cohere's Command R (CohereForCausalLM) and Command R7B (Cohere2ForCausalLM): attention and
a gated SiLU MLP side by side on one bias-free LayerNorm, a rotary that turns adjacent pairs,
the logits times logit_scale, the embedding as the head; Command R+'s per-head q/k LayerNorms;
Command R7B's windowed layers beside full ones that turn no rotary. Greedy tokens and first
log-probs held to transformers in float32, the native walk in bf16 near transformers' float32,
a LoRA adapter held to PEFT (its q/k rows regrouped as the weights'); two ranks held to transformers
(Command R+'s head norms refused by name there)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from helpers_engine import bf16_alone_equals_batched
from helpers_models import assert_bf16_walk_near_float32, assert_greedy_is_transformers, write_tiny_hf_model

from kvloom import SamplingParams
from kvloom.config import ModelConfig

transformers = pytest.importorskip("transformers")

RNG = random.Random(19)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             tie_word_embeddings=True)
# Command R7B's pattern at a tiny size: every second layer full (transformers' default is every fourth).
WINDOWED = dict(sliding_window=20, num_hidden_layers=4, sliding_window_pattern=2)


@pytest.fixture(scope="module")
def cohere(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("cohere"), arch="cohere", seed=61, **SHAPE)


@pytest.fixture(scope="module")
def cohere2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("cohere2"), arch="cohere2", seed=62, **SHAPE, **WINDOWED)


def test_greedy_tokens_and_logprobs_are_transformers(cohere: Path) -> None:
    config = assert_greedy_is_transformers(cohere, PROMPTS, 12).engine.model_config
    assert config.interleaved_rotary and config.tie_word_embeddings and config.scales is not None
    assert (config.scales.logit_scale, config.qk_norm, config.attention_output_bias) == (0.0625, False, False)


def test_command_r_plus_head_norms_are_transformers(tmp_path: Path) -> None:
    """use_qk_norm: each head's LayerNorm weights regrouped with the rows they norm."""
    path = write_tiny_hf_model(tmp_path / "cohere-qk", arch="cohere", seed=63, use_qk_norm=True, **SHAPE)
    assert assert_greedy_is_transformers(path, PROMPTS, 8).engine.model_config.qk_norm
    bf16_alone_equals_batched(str(path), PROMPTS[1:], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))


def test_command_r7b_windows_and_full_layers_are_transformers(cohere2: Path) -> None:
    config = assert_greedy_is_transformers(cohere2, PROMPTS, 12).engine.model_config
    assert (config.full_attention_layers, config.no_rope_layers, config.sliding_window) == ((1, 3), (1, 3), 20)
    # Older configs give the pattern alone (transformers derives the layer kinds from it).
    hf = json.loads((cohere2 / "config.json").read_text())
    del hf["layer_types"]
    older = ModelConfig.from_hf({**hf, "sliding_window_pattern": 2})
    assert (older.full_attention_layers, older.no_rope_layers) == ((1, 3), (1, 3))


def test_bf16_native_walk_log_probs_are_transformers_float32s(cohere2: Path) -> None:
    """The walk side by side (stream + attention, then + MLP), bias-free LayerNorms, windows."""
    assert_bf16_walk_near_float32(cohere2, PROMPTS)


def test_a_lora_adapter_is_peft(cohere: Path, tmp_path: Path) -> None:
    from helpers_lora import TARGETS_ALL, assert_adapter_is_peft

    assert_adapter_is_peft(cohere, tmp_path / "adapter", PROMPTS[2:], TARGETS_ALL)


def test_two_ranks_give_transformers_greedy_tokens(cohere2: Path, tmp_path: Path) -> None:
    """Each rank regroups its own heads' rows; the side-by-side blocks each all-reduce before
    they are added. Command R+'s per-head norms: each rank reads its heads' rows of them."""
    assert_greedy_is_transformers(cohere2, PROMPTS[1:3], 6, tensor_parallel_size=2)
    plus = write_tiny_hf_model(tmp_path / "cohere-qk", arch="cohere", seed=64, use_qk_norm=True, **SHAPE)
    assert_greedy_is_transformers(plus, PROMPTS[1:3], 6, tensor_parallel_size=2)
