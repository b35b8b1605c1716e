"""Meta's OPT: learned positions two rows ahead (no rotary), GPT-2's pre-LayerNorm layer with
separate q/k/v projections, a ReLU MLP, the embedding as the head. Greedy tokens and first
log-probs held to transformers in float32 (both attention backends, tied and untied heads,
facebook/opt-*'s checkpoint names), bf16 alone equal to batched and chunked and the native
walk near transformers' float32, a LoRA adapter on every projection held to PEFT; OPT-350m's
shape, a context past its positions and two ranks refused by name."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from helpers_engine import bf16_alone_equals_batched
from helpers_models import assert_bf16_walk_near_float32, assert_greedy_is_transformers, write_tiny_hf_model
from helpers_models import hf_greedy_and_first_logprobs as reference_run

from kvloom import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

RNG = random.Random(17)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
SHAPE = dict(hidden_size=128, ffn_dim=256, num_attention_heads=4, max_position_embeddings=128,
             tie_word_embeddings=True)


@pytest.fixture(scope="module")
def opt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("opt"), arch="opt", seed=51, **SHAPE)


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
def test_greedy_tokens_and_logprobs_are_transformers(opt: Path, backend: str) -> None:
    llm = assert_greedy_is_transformers(opt, PROMPTS, GREEDY.max_tokens, attention_backend=backend)
    config = llm.engine.model_config
    assert (config.intermediate_size, config.num_kv_heads, config.hidden_act, config.rms_norm_eps) == \
        (256, 4, "relu", 1e-5)
    assert config.tie_word_embeddings and config.no_rope_layers == (0, 1) and llm.engine.max_model_len == 128


def test_an_untied_head_is_transformers(tmp_path: Path) -> None:
    path = write_tiny_hf_model(tmp_path / "opt-untied", arch="opt", seed=52, **{**SHAPE, "tie_word_embeddings": False})
    assert not assert_greedy_is_transformers(path, PROMPTS, 8).engine.model_config.tie_word_embeddings


def test_facebook_checkpoint_names_are_read(opt: Path, tmp_path: Path) -> None:
    """facebook/opt-*'s files name the tensors from ``decoder.`` (OPTModel's names) and keep
    a copy of the tied head."""
    from safetensors.torch import load_file, save_file

    copy = Path(shutil.copytree(opt, tmp_path / "opt-facebook"))
    state = {name.removeprefix("model."): tensor for name, tensor in load_file(str(copy / "model.safetensors")).items()}
    assert "decoder.final_layer_norm.weight" in state and "decoder.layers.0.final_layer_norm.weight" in state
    state["lm_head.weight"] = state["decoder.embed_tokens.weight"].clone()
    save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
    outputs = LLM(str(copy), dtype="float32", num_blocks=64).generate(PROMPTS[1:3], GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [reference_run(opt, p, GREEDY.max_tokens)[0]
                                                               for p in PROMPTS[1:3]]


def test_bf16_tokens_alone_equal_batched_and_chunked(opt: Path) -> None:
    bf16_alone_equals_batched(str(opt), PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))


def test_bf16_native_walk_log_probs_are_transformers_float32s(opt: Path) -> None:
    """The walk with LayerNorms, the ReLU MLP and no rotary (learned positions)."""
    assert_bf16_walk_near_float32(opt, PROMPTS)


def test_an_adapter_on_every_projection_is_peft(opt: Path, tmp_path: Path) -> None:
    """OPT's names: out_proj is the o projection, fc1 / fc2 the MLP's up and down."""
    from helpers_lora import FAMILY_TARGETS, assert_adapter_is_peft

    assert_adapter_is_peft(opt, tmp_path / "adapter", PROMPTS[2:], FAMILY_TARGETS["opt"][0])


def test_two_ranks_give_transformers_greedy_tokens(opt: Path) -> None:
    """facebook's names through OPT's renames to the rules that cut each tensor (fc1's rows,
    fc2's columns); the learned positions are every rank's."""
    assert_greedy_is_transformers(opt, PROMPTS[1:3], 6, tensor_parallel_size=2)


def test_what_it_cannot_run_is_refused_by_name(opt: Path, tmp_path: Path) -> None:
    with pytest.raises(Exception, match="max_model_len 1000 is longer than the model allows: its 128 positions"):
        LLM(str(opt), dtype="float32", num_blocks=16, max_model_len=1000)
    post = write_tiny_hf_model(tmp_path / "opt-post", arch="opt", seed=53, do_layer_norm_before=False, **SHAPE)
    with pytest.raises(Exception, match="do_layer_norm_before false"):
        LLM(str(post), dtype="float32", num_blocks=16)
    projected = write_tiny_hf_model(tmp_path / "opt-350m", arch="opt", seed=54, word_embed_proj_dim=64, **SHAPE)
    with pytest.raises(Exception, match="word_embed_proj_dim 64 differs from its hidden_size 128"):
        LLM(str(projected), dtype="float32", num_blocks=16)
