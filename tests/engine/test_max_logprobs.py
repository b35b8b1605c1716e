"""``max_logprobs`` (vLLM's ``--max-logprobs``): the most log-probabilities a token a
request may ask for. Past it a request is refused by name and the engine goes on;
raised (or -1, the whole vocabulary) the engine serves them, equal to transformers'; a
beam search, whose rounds ask for twice its width, is refused before its first round."""

from __future__ import annotations

import pytest
import torch
from helpers_beam import naive_beam_search

from kvloom import LLM, BeamSearchParams, SamplingParams
from kvloom.config import EngineConfig
from kvloom.engine.admission import RequestRejected
from kvloom.engine.engine import LLMEngine

PROMPT = [3, 17, 99, 250, 41, 7, 7, 300, 12, 88, 151, 9]


@pytest.fixture(scope="module")
def reference_model(tiny_llama) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def engine_with(tiny_llama, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(str(tiny_llama), dtype="float32", block_size=4, num_blocks=64,
                                              **kwargs))


def finish(engine: LLMEngine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    engine.check_integrity()
    assert engine.kv_manager.num_available_blocks == engine.num_blocks
    return finals


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_past_the_default_twenty_a_request_is_refused_by_name_and_the_engine_goes_on(tiny_llama, field) -> None:
    engine = engine_with(tiny_llama)
    assert engine.limits.max_logprobs == 20  # vLLM's default
    engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=0.0, **{field: 20}), request_id="at")
    with pytest.raises(RequestRejected, match=rf"{field} asks for 21 .* max_logprobs \(20; --max-logprobs") as error:
        engine.add_request(PROMPT, SamplingParams(max_tokens=3, **{field: 21}), request_id="past")
    assert error.value.param == field
    finals = finish(engine)
    assert set(finals) == {"at"} and len(finals["at"].outputs[0].token_ids) == 3


def test_minus_one_serves_the_whole_vocabulary_as_transformers_computes_it(tiny_llama, reference_model) -> None:
    engine = engine_with(tiny_llama, max_logprobs=-1)
    vocab = reference_model.config.vocab_size
    assert engine.limits.max_logprobs == vocab
    engine.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0.0, logprobs=vocab, prompt_logprobs=40),
                       request_id="all")
    output = finish(engine)["all"]
    with torch.no_grad():
        expected = torch.log_softmax(reference_model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)  # [P, V]
    last = output.outputs[0].logprobs[0]
    assert len(last) == vocab  # every id once: the sampled one is among the top V
    assert max(abs(last[token].logprob - expected[-1, token].item()) for token in range(vocab)) < 1e-4
    assert sorted(last[token].rank for token in range(vocab)) == list(range(1, vocab + 1))
    for position in range(1, len(PROMPT)):  # the prompt's, 40 a token (past the default 20)
        entry = output.prompt_logprobs[position]
        top = expected[position - 1].topk(40).indices.tolist()
        assert set(top) <= set(entry) and len(entry) in (40, 41)


def test_a_beam_search_wider_than_half_the_limit_is_refused_before_its_first_round(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64)
    with pytest.raises(ValueError, match=r"beam_width 11 asks for 22 .* max_logprobs \(20\); --max-logprobs 22"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=11, max_tokens=3))
    assert llm.engine.scheduler.num_prefill_tokens == 0 and not llm.engine.has_unfinished_requests()


def test_with_the_limit_raised_a_wide_beam_search_is_the_naive_searchs(tiny_llama, reference_model) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=256, max_logprobs=24)
    width, new = 12, 4
    beams = llm.beam_search([PROMPT], BeamSearchParams(width, new, ignore_eos=True))[0].sequences
    expected = naive_beam_search(reference_model, PROMPT, width, new, set(), 1.0)
    assert [b.token_ids for b in beams] == [tokens for tokens, _, _ in expected]
    for beam, (_, cum, _) in zip(beams, expected, strict=True):
        assert beam.cum_logprob == pytest.approx(cum, abs=1e-4)
    llm.engine.check_integrity()
