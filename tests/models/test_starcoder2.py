"""BigCode's StarCoder2: Llama's attention with biases and a sliding window, LayerNorm with
a bias, a plain GELU MLP. Greedy tokens and first log-probs held to transformers in float32
(chunked, both attention backends, past the window), bf16 alone equal to batched and
chunked; two ranks refused by name."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_engine import bf16_alone_equals_batched
from helpers_models import assert_bf16_walk_near_float32, assert_greedy_is_transformers, write_tiny_hf_model
from helpers_models import hf_greedy_and_first_logprobs as reference_run

from kvloom import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

RNG = random.Random(5)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def starcoder2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("starcoder2"), arch="starcoder2", seed=14, hidden_size=128,
                               intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                               sliding_window=12, norm_epsilon=1e-5)


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
def test_greedy_tokens_and_logprobs_are_transformers(starcoder2: Path, backend: str) -> None:
    llm = LLM(str(starcoder2), dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=16,
              attention_backend=backend)
    assert [layer.self_attn.window for layer in llm.engine.model.layers] == [12, 12]
    for output, prompt in zip(llm.generate(PROMPTS, GREEDY), PROMPTS, strict=True):
        tokens, first = reference_run(starcoder2, prompt, GREEDY.max_tokens)
        assert list(output.outputs[0].token_ids) == tokens, prompt
        assert output.outputs[0].logprobs[0][tokens[0]].logprob == pytest.approx(first[tokens[0]].item(), abs=1e-4)


def test_bf16_tokens_alone_equal_batched_and_chunked(starcoder2: Path) -> None:
    together = bf16_alone_equals_batched(str(starcoder2), PROMPTS, SamplingParams(max_tokens=10, temperature=0.0,
                                                                                   ignore_eos=True))
    assert together.model.native_stack is not None  # bf16 on a CPU: the native walk ran its layers


def test_bf16_native_walk_log_probs_are_transformers_float32s(starcoder2: Path) -> None:
    """The walk with LayerNorms, the un-gated GELU MLP, biases and the window."""
    assert_bf16_walk_near_float32(starcoder2, PROMPTS)


def test_two_ranks_give_transformers_greedy_tokens(starcoder2: Path) -> None:
    """Each rank holds its heads and its share of the un-gated MLP's features (c_fc's rows,
    c_proj's columns, c_proj's bias added by rank 0 alone); fc2's partial sums all-reduced."""
    assert_greedy_is_transformers(starcoder2, PROMPTS[1:3], 6, tensor_parallel_size=2)


def test_a_gguf_file_gives_transformers_greedy_tokens(starcoder2: Path, tmp_path: Path) -> None:
    """llama.cpp's starcoder2 files: LayerNorm weights and biases, c_fc / c_proj as ffn_up /
    ffn_down, the eps as layer_norm_epsilon, Q/K rows as HF's."""
    from helpers_models import write_tiny_gguf

    llm = LLM(str(write_tiny_gguf(starcoder2, tmp_path / "starcoder2.gguf")), dtype="float32", block_size=16,
              num_blocks=64)
    assert llm.engine.model_config.architecture == "Starcoder2ForCausalLM"
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [reference_run(starcoder2, p, GREEDY.max_tokens)[0]
                                                               for p in PROMPTS]


def test_an_adapter_on_every_projection_is_peft(starcoder2: Path, tmp_path: Path) -> None:
    """Llama's attention names, and c_fc / c_proj for the un-gated MLP."""
    from helpers_lora import FAMILY_TARGETS, assert_adapter_is_peft

    assert_adapter_is_peft(starcoder2, tmp_path / "adapter", PROMPTS[2:], FAMILY_TARGETS["starcoder2"][0])
