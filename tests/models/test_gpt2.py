"""OpenAI's GPT-2: learned positions (no rotary), pre-LayerNorm layers, Conv1D weights, an
un-gated gelu_new MLP, the embedding as the head. Greedy tokens and first log-probs held to
transformers in float32 (chunked, both attention backends, tied and untied heads, from llama.cpp's
gpt2 GGUF files, with old checkpoints' saved masks beside the weights), bf16 alone equal to
batched and chunked, a layer-skip draft of its own layers; a context past its positions, other
attention scales and two ranks refused by name."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_engine import bf16_alone_equals_batched, layer_skip_keeps_greedy_tokens
from helpers_models import assert_bf16_walk_near_float32, assert_greedy_is_transformers, write_tiny_hf_model
from helpers_models import hf_greedy_and_first_logprobs as reference_run

from kvloom import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

RNG = random.Random(13)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
SHAPE = dict(hidden_size=128, num_attention_heads=4, max_position_embeddings=128, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("gpt2"), arch="gpt2", seed=41, **SHAPE)


def assert_transformers_tokens(path: Path, **engine: object) -> LLM:
    return assert_greedy_is_transformers(path, PROMPTS, GREEDY.max_tokens, **engine)


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
def test_greedy_tokens_and_logprobs_are_transformers(gpt2: Path, backend: str) -> None:
    llm = assert_transformers_tokens(gpt2, attention_backend=backend)
    config = llm.engine.model_config
    assert (config.hidden_size, config.intermediate_size, config.num_kv_heads, config.hidden_act) == \
        (128, 512, 4, "gelu_new")
    assert config.tie_word_embeddings and llm.engine.max_model_len == 128  # n_positions


def test_an_untied_head_is_transformers(tmp_path: Path) -> None:
    untied = {**SHAPE, "tie_word_embeddings": False}
    path = write_tiny_hf_model(tmp_path / "gpt2-untied", arch="gpt2", seed=42, **untied)
    assert not assert_transformers_tokens(path).engine.model_config.tie_word_embeddings


def test_bf16_tokens_alone_equal_batched_and_chunked(gpt2: Path) -> None:
    bf16_alone_equals_batched(str(gpt2), PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))


def test_bf16_native_walk_log_probs_are_transformers_float32s(gpt2: Path) -> None:
    """The walk with LayerNorms, the un-gated GELU MLP and no rotary (learned positions)."""
    assert_bf16_walk_near_float32(gpt2, PROMPTS)


def test_its_first_layers_draft_for_it(tmp_path: Path) -> None:
    path = write_tiny_hf_model(tmp_path / "gpt2-4", arch="gpt2", seed=43, num_hidden_layers=4, **SHAPE)
    layer_skip_keeps_greedy_tokens(str(path), PROMPTS[1:3], 2)


def test_saved_masks_beside_the_weights_are_skipped(gpt2: Path, tmp_path: Path) -> None:
    from helpers_models import with_saved_masks

    copy = with_saved_masks(gpt2, tmp_path / "gpt2-masks")
    outputs = LLM(str(copy), dtype="float32", num_blocks=64).generate(PROMPTS[1:3], GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [reference_run(gpt2, p, GREEDY.max_tokens)[0]
                                                               for p in PROMPTS[1:3]]


def test_a_gguf_file_gives_transformers_greedy_tokens(gpt2: Path, tmp_path: Path) -> None:
    """llama.cpp's gpt2 files: its matmuls as [out, in] (transposed back from Conv1D's), the
    positions as position_embd, LayerNorm biases, no output head (the embedding is)."""
    from helpers_models import write_tiny_gguf

    llm = LLM(str(write_tiny_gguf(gpt2, tmp_path / "gpt2.gguf")), dtype="float32", block_size=16, num_blocks=64)
    config = llm.engine.model_config
    assert (config.architecture, config.intermediate_size, config.tie_word_embeddings) == \
        ("GPT2LMHeadModel", 512, True)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [reference_run(gpt2, p, GREEDY.max_tokens)[0]
                                                               for p in PROMPTS]


def test_two_ranks_give_transformers_greedy_tokens(gpt2: Path) -> None:
    """Conv1D weights ([in, out]) cut along their columns for fc1 and their rows for fc2 and
    o (the cut turned with them); c_attn read whole and cut part by part once transposed."""
    assert_greedy_is_transformers(gpt2, PROMPTS[1:3], 6, tensor_parallel_size=2)


def test_what_it_cannot_run_is_refused_by_name(gpt2: Path, tmp_path: Path) -> None:
    with pytest.raises(Exception, match="max_model_len 1000 is longer than the model allows: its 128 positions"):
        LLM(str(gpt2), dtype="float32", num_blocks=16, max_model_len=1000)
    scaled = write_tiny_hf_model(tmp_path / "gpt2-scaled", arch="gpt2", seed=44, scale_attn_by_inverse_layer_idx=True,
                                 **SHAPE)
    with pytest.raises(Exception, match="scale_attn_by_inverse_layer_idx on"):
        LLM(str(scaled), dtype="float32", num_blocks=16)


def test_an_adapter_on_every_projection_is_peft(gpt2: Path, tmp_path: Path) -> None:
    """GPT-2's Conv1D names (PEFT sets fan_in_fan_out for them, which changes no A or B):
    c_attn is q, k and v in one (each part's rows of B), c_proj both the attention's output
    and the MLP's."""
    from helpers_lora import FAMILY_TARGETS, assert_adapter_is_peft

    assert_adapter_is_peft(gpt2, tmp_path / "adapter", PROMPTS[2:], FAMILY_TARGETS["gpt2"][0])
