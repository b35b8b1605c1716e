"""Stability AI's StableLM: Llama's attention and gated MLP with LayerNorms, a partial rotary,
q/k/v biases, per-head q/k LayerNorms, the parallel residual (or not). Greedy tokens and first
log-probs held to transformers in float32 (chunked, both attention backends, both residual
forms, from llama.cpp's stablelm GGUF files), bf16 alone equal to batched and chunked; two ranks
and other activations refused by name."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_engine import bf16_alone_equals_batched
from helpers_models import assert_bf16_walk_near_float32, assert_greedy_is_transformers, write_tiny_hf_model
from helpers_models import hf_greedy_and_first_logprobs as reference_run

from kvloom import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

RNG = random.Random(14)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
# StableLM 2's form: q/k/v biases, per-head q/k norms (grouped KV heads), a quarter of each head rotated.
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             partial_rotary_factor=0.25, layer_norm_eps=1e-5, use_qkv_bias=True, qk_layernorm=True)


@pytest.fixture(scope="module")
def stablelm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("stablelm"), arch="stablelm", seed=51, **SHAPE)


def assert_transformers_tokens(path: Path, **engine: object) -> LLM:
    return assert_greedy_is_transformers(path, PROMPTS, GREEDY.max_tokens, **engine)


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
def test_greedy_tokens_and_logprobs_are_transformers(stablelm: Path, backend: str) -> None:
    llm = assert_transformers_tokens(stablelm, attention_backend=backend)
    config = llm.engine.model_config
    assert (config.rotary_dim, config.attention_bias, config.qk_norm, config.parallel_residual) == \
        (8, True, True, False)


def test_the_parallel_residual_is_transformers(tmp_path: Path) -> None:
    """StableLM 2 12B's form: attention and MLP from one norm, added together; no q/k norms."""
    shape = {**SHAPE, "use_parallel_residual": True, "qk_layernorm": False, "use_qkv_bias": False}
    path = write_tiny_hf_model(tmp_path / "stablelm-parallel", arch="stablelm", seed=52, **shape)
    llm = assert_transformers_tokens(path)
    assert llm.engine.model.layers[0].post_attention_layernorm is None
    # bf16 on a CPU: the native walk (the attention's output added into the stream first).
    assert_bf16_walk_near_float32(path, PROMPTS)


def test_bf16_native_walk_refuses_head_layernorms_and_runs_the_rest(stablelm: Path, tmp_path: Path) -> None:
    """qk_layernorm's per-head LayerNorms keep the modules; without them the walk runs."""
    llm = LLM(str(stablelm), dtype="bfloat16", num_blocks=32)
    assert llm.engine.model.native_stack is None
    plain = write_tiny_hf_model(tmp_path / "stablelm-plain", arch="stablelm", seed=53,
                                **{**SHAPE, "qk_layernorm": False})
    assert_bf16_walk_near_float32(plain, PROMPTS)


def test_bf16_tokens_alone_equal_batched_and_chunked(stablelm: Path) -> None:
    bf16_alone_equals_batched(str(stablelm), PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))


def test_a_gguf_file_gives_transformers_greedy_tokens(stablelm: Path, tmp_path: Path) -> None:
    """llama.cpp's stablelm files: the per-head q/k norms stacked [heads, head_dim], the
    rotary's dims and the residual form as metadata."""
    from helpers_models import write_tiny_gguf

    llm = LLM(str(write_tiny_gguf(stablelm, tmp_path / "stablelm.gguf")), dtype="float32", block_size=16,
              num_blocks=64)
    config = llm.engine.model_config
    assert (config.architecture, config.qk_norm, config.parallel_residual) == ("StableLmForCausalLM", True, False)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [reference_run(stablelm, p, GREEDY.max_tokens)[0]
                                                               for p in PROMPTS]


def test_two_ranks_give_transformers_greedy_tokens(stablelm: Path) -> None:
    """Each rank holds its heads' per-head q/k norms (the checkpoint's tensors of those heads)."""
    assert_greedy_is_transformers(stablelm, PROMPTS[1:3], 6, tensor_parallel_size=2)


def test_other_activations_are_refused_by_name(stablelm: Path, tmp_path: Path) -> None:
    gelu = write_tiny_hf_model(tmp_path / "stablelm-gelu", arch="stablelm", seed=53, hidden_act="gelu", **SHAPE)
    with pytest.raises(Exception, match="StableLmForCausalLM: hidden_act 'gelu' is not supported"):
        LLM(str(gelu), dtype="float32", num_blocks=16)


def test_a_lora_adapter_is_peft_on_stablelm(stablelm: Path, tmp_path: Path) -> None:
    """Llama's projection names (StableLM's own): the deltas go where PEFT puts them, past the
    per-head q/k norms' input."""
    from helpers_lora import TARGETS_ALL, assert_adapter_is_peft

    assert_adapter_is_peft(stablelm, tmp_path / "adapter", PROMPTS[2:], TARGETS_ALL)
