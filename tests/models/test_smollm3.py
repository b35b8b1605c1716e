"""Hugging Face's SmolLM3: Llama with no rotary in every fourth layer (NoPE; config.json's
no_rope_layers flags, else no_rope_layer_interval). Greedy tokens and first log-probs held to
transformers in float32 (chunked, both attention backends), bf16 alone equal to batched and
chunked in the native walk (which skips the rotary in those layers; bit for bit the modules' in
tests/models/test_decoder_stack.py), llama.cpp's smollm3 GGUF files (NoPE every fourth layer,
as llama.cpp assumes)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_engine import bf16_alone_equals_batched
from helpers_models import assert_greedy_is_transformers, write_tiny_hf_model
from helpers_models import hf_greedy_and_first_logprobs as reference_run

from kvloom import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

RNG = random.Random(15)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=4, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layers 1 and 3 without rotary (an interval of 2, so that a short model has two)."""
    return write_tiny_hf_model(tmp_path_factory.mktemp("smollm3"), arch="smollm3", seed=61, no_rope_layer_interval=2,
                               **SHAPE)


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
def test_greedy_tokens_and_logprobs_are_transformers(smollm3: Path, backend: str) -> None:
    llm = assert_greedy_is_transformers(smollm3, PROMPTS, GREEDY.max_tokens, attention_backend=backend)
    assert llm.engine.model_config.no_rope_layers == (1, 3)


def test_bf16_tokens_alone_equal_batched_and_chunked_in_the_native_walk(smollm3: Path) -> None:
    engine = bf16_alone_equals_batched(str(smollm3), PROMPTS, SamplingParams(max_tokens=10, temperature=0.0,
                                                                              ignore_eos=True))
    assert engine.model.native_stack is not None


def test_a_gguf_file_gives_transformers_greedy_tokens(tmp_path: Path) -> None:
    """llama.cpp's smollm3 files record no NoPE layers: it takes every fourth, as SmolLM3-3B has them."""
    from helpers_models import write_tiny_gguf

    model = write_tiny_hf_model(tmp_path / "smollm3-4", arch="smollm3", seed=62, **SHAPE)  # the interval of 4
    llm = LLM(str(write_tiny_gguf(model, tmp_path / "smollm3.gguf")), dtype="float32", block_size=16, num_blocks=64)
    assert (llm.engine.model_config.architecture, llm.engine.model_config.no_rope_layers) == \
        ("SmolLM3ForCausalLM", (3,))
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [reference_run(model, p, GREEDY.max_tokens)[0]
                                                               for p in PROMPTS]
