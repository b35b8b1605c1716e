"""``LLM.beam_search`` on the default model (fp32) against transformers: its own beam
search (``generate(num_beams=...)``) where EOS plays no part, and a naive search over
transformers' logits (every beam's whole sequence recomputed each round, vLLM's rules)
where beams end at EOS and the length penalty ranks them."""

from __future__ import annotations

import math

import pytest
import torch
from helpers_beam import naive_beam_search

from kvloom import LLM, BeamSearchParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "The three primary colors are"]


@pytest.fixture(scope="module")
def llm(default_llm_float32: LLM) -> LLM:
    return default_llm_float32


def test_beams_match_transformers_num_beams(llm: LLM, default_model_reference: torch.nn.Module) -> None:
    """Without EOS (ignore_eos here; EOS masked there by min_new_tokens, after the
    log-softmax, so no other score moves), every beam has max_tokens tokens and both rank
    them by their summed log-probabilities: the same beams in the same order."""
    width, new = 3, 8
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    computed = llm.engine.scheduler.num_prefill_tokens
    outputs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=new, ignore_eos=True))
    # The first round computes the prompts; after it each beam computes its newest token
    # alone: the radix cache serves the rest, whole blocks and the previous round's tails.
    computed = llm.engine.scheduler.num_prefill_tokens - computed
    assert computed == sum(map(len, prompts)) + (new - 1) * width * len(prompts)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.prompt_token_ids == prompt
        beams = output.sequences
        assert len(beams) == width and all(len(b.token_ids) == new and b.finish_reason == "length" for b in beams)
        assert not any(set(b.token_ids) & set(llm.engine.eos_token_ids) for b in beams)  # so EOS took no part
        with torch.no_grad():
            expected = default_model_reference.generate(
                torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                max_new_tokens=new, min_new_tokens=new, length_penalty=0.0, early_stopping=False,
                output_scores=True, return_dict_in_generate=True, pad_token_id=llm.engine.eos_token_ids[0])
        assert [b.token_ids for b in beams] == [row[len(prompt):].tolist() for row in expected.sequences]
        # length_penalty 0: transformers' sequence score is the sum of the log-probabilities
        for beam, score in zip(beams, expected.sequences_scores.tolist(), strict=True):
            assert beam.cum_logprob == pytest.approx(score, abs=2e-3)
            assert sum(beam.logprobs) == pytest.approx(beam.cum_logprob, abs=1e-4)
        assert beams[0].text == llm.tokenizer.decode(beams[0].token_ids, skip_special_tokens=True)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()


@pytest.mark.parametrize("length_penalty", [0.5, 2.0])
def test_beams_that_end_at_eos_match_a_naive_search(llm: LLM, default_model_reference: torch.nn.Module,
                                                    length_penalty: float) -> None:
    prompt = llm.encode_chat([{"role": "user", "content": "Reply with one word: yes or no?"}])
    width, new = 2, 6
    beams = llm.beam_search([prompt], BeamSearchParams(width, new, length_penalty=length_penalty))[0].sequences
    expected = naive_beam_search(default_model_reference, prompt, width, new, set(llm.engine.eos_token_ids),
                                 length_penalty)
    assert [(b.token_ids, b.finish_reason) for b in beams] == [(tokens, reason) for tokens, _, reason in expected]
    for beam, (_, cum, _) in zip(beams, expected, strict=True):
        assert beam.cum_logprob == pytest.approx(cum, abs=2e-3)
    assert any(b.finish_reason == "stop" for b in beams)  # an EOS beam is among the best
    stopped = next(b for b in beams if b.finish_reason == "stop")
    assert stopped.text == llm.tokenizer.decode(stopped.token_ids[:-1], skip_special_tokens=True)
    assert not math.isnan(stopped.cum_logprob)
    llm.engine.check_integrity()


def test_a_search_past_the_context_is_refused_before_it_starts(llm: LLM) -> None:
    limit = llm.engine.max_model_len
    message = f"prompt 1's 3 tokens and max_tokens {limit - 2} exceed the model's context of {limit}"
    with pytest.raises(ValueError, match=message):
        llm.beam_search([[5, 6], [5, 6, 7]], BeamSearchParams(2, limit - 2))
    assert not llm.engine.has_unfinished_requests()
