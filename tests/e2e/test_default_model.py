"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the
same GGUF: greedy identity on 8 real prompts x 32 new tokens (fp32)."""

from __future__ import annotations

import pytest
from helpers_models import default_model_path, hf_greedy_with_cache

from kvloom import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "To make a cup of tea, first",
    "The largest planet in our solar system is",
    "In machine learning, overfitting means",
]


@pytest.fixture(scope="module")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="module")
def llm(gguf_path):
    return LLM("smollm2-135m-instruct", dtype="float32", num_blocks=256)


def test_greedy_matches_transformers_on_default_model(gguf_path, llm, default_model_reference) -> None:
    reference = default_model_reference
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=False):
        expected = hf_greedy_with_cache(reference, prompt, 32)
        assert output.outputs[0].token_ids == expected
    llm.engine.check_integrity()


def test_chat_answer_is_sensible(llm) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert "Paris" in out.outputs[0].text


def test_prefix_cache_on_and_off_agree_on_default_model(llm) -> None:
    """Chat prompts share the template's system prompt (and, here, a long user
    preamble whose end splits a block): cached and uncached runs must agree."""
    preamble = "You are reviewing short statements about science and geography. " * 4
    conversations = [[{"role": "user", "content": preamble + p}] for p in PROMPTS]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    cached = llm.chat(conversations, params)
    assert sum(o.num_cached_tokens for o in cached) > 0
    uncached_llm = LLM("smollm2-135m-instruct", dtype="float32", num_blocks=256, enable_prefix_caching=False)
    uncached = uncached_llm.chat(conversations, params)
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in uncached]
    llm.engine.check_integrity()
