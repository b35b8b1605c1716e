"""Baidu's ERNIE 4.5 (dense, ``Ernie4_5ForCausalLM``: ERNIE-4.5-0.3B): Llama's layers with one
bias flag for every projection and a rotary that turns adjacent pairs of each head (GLM's), served
by Llama's rotary after its q/k rows are regrouped at load. Greedy tokens and first log-probs held
to transformers in float32 (chunked, both attention backends, with and without biases), bf16
alone equal to batched and chunked in the native walk, llama.cpp's ernie4_5 GGUF files."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_engine import bf16_alone_equals_batched
from helpers_models import assert_greedy_is_transformers, write_tiny_hf_model
from helpers_models import hf_greedy_and_first_logprobs as reference_run

from kvloom import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

RNG = random.Random(16)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             tie_word_embeddings=True)


@pytest.fixture(scope="module")
def ernie(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("ernie"), arch="ernie4_5", seed=71, use_bias=True, **SHAPE)


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
def test_greedy_tokens_and_logprobs_are_transformers(ernie: Path, backend: str) -> None:
    llm = assert_greedy_is_transformers(ernie, PROMPTS, GREEDY.max_tokens, attention_backend=backend)
    config = llm.engine.model_config
    assert (config.interleaved_rotary, config.attention_bias, config.attention_output_bias, config.mlp_bias) == \
        (True, True, True, True)


def test_bf16_tokens_alone_equal_batched_and_chunked_in_the_native_walk(tmp_path: Path) -> None:
    plain = write_tiny_hf_model(tmp_path / "ernie-plain", arch="ernie4_5", seed=72, use_bias=False, **SHAPE)
    assert_greedy_is_transformers(plain, PROMPTS[:2], 8)
    engine = bf16_alone_equals_batched(str(plain), PROMPTS, SamplingParams(max_tokens=10, temperature=0.0,
                                                                            ignore_eos=True))
    assert engine.model.native_stack is not None  # Llama's layers once the rows are regrouped


def test_a_gguf_file_gives_transformers_greedy_tokens(ernie: Path, tmp_path: Path) -> None:
    from helpers_models import write_tiny_gguf

    llm = LLM(str(write_tiny_gguf(ernie, tmp_path / "ernie.gguf")), dtype="float32", block_size=16, num_blocks=64)
    assert (llm.engine.model_config.architecture, llm.engine.model_config.attention_bias) == \
        ("Ernie4_5ForCausalLM", True)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [reference_run(ernie, p, GREEDY.max_tokens)[0]
                                                               for p in PROMPTS]


def test_a_lora_adapter_is_peft_on_ernie(ernie: Path, tmp_path: Path) -> None:
    """The adapter's q and k deltas are regrouped as the base's rows are: PEFT's output."""
    from helpers_lora import TARGETS_ALL, check_against_peft, reference_model, write_adapter

    from kvloom import LoRARequest

    adapter = write_adapter(ernie, tmp_path / "adapter", 1, 4, TARGETS_ALL)
    llm = LLM(str(ernie), dtype="float32", block_size=16, num_blocks=64, enable_lora=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = llm.generate(PROMPTS[2:], params, lora_request=LoRARequest("a", 1, str(adapter)))
    reference = reference_model(ernie, adapter)
    for prompt, output in zip(PROMPTS[2:], outputs, strict=True):
        check_against_peft(reference, prompt, output.outputs[0])
