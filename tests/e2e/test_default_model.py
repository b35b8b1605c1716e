"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the
same GGUF: greedy identity on 8 real prompts x 32 new tokens (fp32)."""

from __future__ import annotations

import pytest
import torch
from helpers_models import default_model_path, hf_greedy_batched, hf_greedy_with_cache

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
def llm(default_llm_float32: LLM) -> LLM:
    return default_llm_float32


def test_greedy_matches_transformers_on_default_model(gguf_path, llm, default_model_reference) -> None:
    reference = default_model_reference
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    outputs = llm.generate(prompts, params)
    expected = hf_greedy_batched(reference, prompts, 32)
    assert [output.outputs[0].token_ids for output in outputs] == expected
    assert expected[0] == hf_greedy_with_cache(reference, prompts[0], 32)  # the batch is one prompt's greedy
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


def hf_greedy_restricted(model, prompt: list[int], max_new_tokens: int, *, allowed: list[int] | None = None,
                         bad_words: list[list[int]] = ()) -> list[int]:
    """transformers' KV-cached forward, argmax each step over the tokens the rules leave:
    only ``allowed`` (when given), and no token that would complete a bad word (its other
    tokens ending the output so far; a one-token word never)."""
    tokens: list[int] = []
    past, inputs = None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(inputs, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1].clone()
            if allowed is not None:
                keep = logits[allowed]
                logits[:] = float("-inf")
                logits[allowed] = keep
            for word in bad_words:
                if len(word) - 1 <= len(tokens) and tokens[len(tokens) - len(word) + 1:] == word[:-1]:
                    logits[word[-1]] = float("-inf")
            tokens.append(int(logits.argmax()))
            inputs = torch.tensor([[tokens[-1]]])
    return tokens


def test_bad_words_and_allowed_token_ids_match_transformers_restricted(llm, default_model_reference) -> None:
    """vLLM's two restrictions against transformers' logits restricted by hand, greedy."""
    tokenizer = llm.tokenizer
    prompt = tokenizer.encode("The capital of France is")
    plain = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert "Paris" in plain.outputs[0].text  # so that banning it changes the output
    words = ["Paris", "France"]
    sequences = [tokenizer.encode(w, add_special_tokens=False) for w in words]
    sequences += [tokenizer.encode(" " + w, add_special_tokens=False) for w in words]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, bad_words=words)
    banned = llm.generate([prompt], params)[0].outputs[0]
    assert banned.token_ids == hf_greedy_restricted(default_model_reference, prompt, 12, bad_words=sequences)
    assert "Paris" not in banned.text and "France" not in banned.text
    allowed = sorted({t for w in (" a", " the", " city", " of", " big", ".", ",") for t in tokenizer.encode(
        w, add_special_tokens=False)})
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, allowed_token_ids=allowed)
    only = llm.generate([prompt], params)[0].outputs[0]
    assert set(only.token_ids) <= set(allowed)
    assert only.token_ids == hf_greedy_restricted(default_model_reference, prompt, 10, allowed=allowed)
    llm.engine.check_integrity()


def test_embeddings_are_transformers_last_hidden_state(llm, default_model_reference) -> None:
    """LLM.embed (last-token pooling): transformers' final hidden state of each prompt's
    last token (after the final norm), L2-normalized."""
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    outputs = llm.embed(prompts)
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            hidden = default_model_reference(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1]
        expected = torch.nn.functional.normalize(hidden[0, -1].float(), dim=-1)
        assert torch.allclose(torch.tensor(output.outputs.embedding), expected, atol=1e-5)
        assert output.prompt_token_ids == prompt
    llm.engine.check_integrity()
