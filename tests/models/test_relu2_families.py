"""The families whose MLP is un-gated ReLU squared: NVIDIA's Nemotron (LayerNorms that scale by
1 + weight, with biases; a partial rotary, half of each head by default) and Arcee's AFM
(Llama's RMSNorms and attention). Greedy tokens and first log-probs held to transformers in
float32, the native walk in bf16 near transformers' float32, a LoRA adapter on every projection
held to PEFT (up_proj / down_proj: kvloom's fc1 / fc2); two ranks refused by name."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_models import (
    assert_bf16_walk_near_float32,
    assert_greedy_is_transformers,
    hf_greedy_and_first_logprobs,
    write_tiny_hf_model,
)

from kvloom import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

RNG = random.Random(23)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {"nemotron": dict(norm_eps=1e-5), "arcee": {}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp(request.param), arch=request.param, seed=71, **SHAPE,
                               **FAMILIES[request.param])


def test_greedy_tokens_and_logprobs_are_transformers(model: Path) -> None:
    config = assert_greedy_is_transformers(model, PROMPTS, 12).engine.model_config
    assert config.hidden_act == "relu2"
    if config.architecture == "NemotronForCausalLM":  # half of each 32-dim head turns (transformers' default)
        assert config.rotary_dim == 16


def test_bf16_native_walk_log_probs_are_transformers_float32s(model: Path) -> None:
    assert_bf16_walk_near_float32(model, PROMPTS)


def test_an_adapter_on_every_projection_is_peft(model: Path, tmp_path: Path) -> None:
    from helpers_lora import TARGETS_ALL, assert_adapter_is_peft

    assert_adapter_is_peft(model, tmp_path / "adapter", PROMPTS[2:], [t for t in TARGETS_ALL if t != "gate_proj"])


def test_two_ranks_give_transformers_greedy_tokens(model: Path) -> None:
    assert_greedy_is_transformers(model, PROMPTS[1:3], 6, tensor_parallel_size=2)


def test_a_gguf_file_gives_transformers_greedy_tokens(model: Path, tmp_path: Path) -> None:
    """llama.cpp's nemotron files: LayerNorm1P weights stored plus one (their biases as they
    are), the rotary's dims and LayerNorm's eps as metadata, the MLP's up and down; its arcee
    files: its Llama files' layout (q/k rows permuted), the MLP's up and down."""
    from helpers_models import write_tiny_gguf

    path = model
    llm = LLM(str(write_tiny_gguf(path, tmp_path / "model.gguf")), dtype="float32", block_size=16, num_blocks=64)
    config = llm.engine.model_config
    nemotron = config.architecture == "NemotronForCausalLM"
    assert (config.rotary_dim or config.head_dim, config.hidden_act) == (16 if nemotron else 32, "relu2")
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    for output, prompt in zip(llm.generate(PROMPTS, params), PROMPTS, strict=True):
        tokens, first = hf_greedy_and_first_logprobs(path, prompt, 10)
        assert list(output.outputs[0].token_ids) == tokens
        assert output.outputs[0].logprobs[0][tokens[0]].logprob == pytest.approx(first[tokens[0]].item(), abs=1e-4)
