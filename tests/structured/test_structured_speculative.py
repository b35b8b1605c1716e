"""Structured output under speculative decoding: drafts are cut to what the grammar
allows before they are verified, every verified position is masked by the grammar in
the state its drafts lead to, and the output is exactly speculation off's (greedy)
or valid (sampled), on the tiny model and the default one."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from structured_helpers import PERSON, SMALL, json_prompt, make_default_engine, run

from kvloom import SamplingParams
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.structured import StructuredOutput


def tiny_engine(path, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(str(path), block_size=8, num_blocks=512, **kwargs))


def outputs(finals) -> dict[str, tuple[list[int], str, str | None]]:
    return {rid: (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
            for rid, o in finals.items()}


def test_tiny_model_constrained_greedy_matches_speculation_off(tiny_llama) -> None:
    rng = random.Random(9)
    requests = {}
    for i in range(6):
        prompt = [rng.randrange(3, 512) for _ in range(12)] * 2
        constraint = (StructuredOutput(json_schema=SMALL) if i % 2 == 0
                      else StructuredOutput(regex=r"(ab|cd|[0-9]{2}){3,12}"))
        requests[f"c{i}"] = (prompt, SamplingParams(max_tokens=60, temperature=0.0, structured=constraint,
                                                    logprobs=1))
    reference = run(tiny_engine(tiny_llama), requests)
    for speculative in ({"method": "draft", "model": str(tiny_llama), "num_speculative_tokens": 4,
                         "adaptive": False},
                        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}):
        engine = tiny_engine(tiny_llama, speculative_config=speculative)
        finals = run(engine, requests)
        assert outputs(finals) == outputs(reference)
        assert {r: o.outputs[0].logprobs for r, o in finals.items()} == \
            {r: o.outputs[0].logprobs for r, o in reference.items()}
        assert engine.stats().num_draft_tokens > 0
        if speculative["method"] == "draft":
            assert engine.stats().num_accepted_tokens > 0
    for rid in ("c0", "c2", "c4"):
        jsonschema.validate(json.loads(reference[rid].outputs[0].text), SMALL)


def test_tiny_model_sampled_constrained_output_stays_valid(tiny_llama) -> None:
    engine = tiny_engine(tiny_llama, speculative_config={"method": "draft", "model": str(tiny_llama),
                                                         "num_speculative_tokens": 3, "adaptive": False})
    requests = {f"s{i}": ([5, 9, 14, 5, 9, 14], SamplingParams(max_tokens=80, temperature=0.9, seed=i,
                                                              structured=StructuredOutput(json_schema=SMALL)))
                for i in range(8)}
    for output in run(engine, requests).values():
        assert output.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(output.outputs[0].text), SMALL)
    assert engine.stats().num_draft_tokens > 0


def test_default_model_json_and_free_text_match_speculation_off() -> None:
    reference_engine = make_default_engine(num_blocks=256)
    constrained = (json_prompt(reference_engine, "a person named Ada Lovelace, born 1815", PERSON),
                   SamplingParams(max_tokens=80, temperature=0.0, structured=StructuredOutput(json_schema=PERSON)))
    text = "Repeat this sentence twice: the cache keeps every block it can share."
    free = (reference_engine.tokenizer.encode_chat([{"role": "user", "content": text}]),
            SamplingParams(max_tokens=48, temperature=0.0))
    requests = {"json": constrained, "free": free}
    reference = run(reference_engine, requests)
    for speculative in ({"method": "ngram", "num_speculative_tokens": 4},
                        {"method": "layer_skip", "num_layers": 12, "num_speculative_tokens": 3,
                         "adaptive": False}):
        engine = make_default_engine(num_blocks=256, speculative_config=speculative)
        assert outputs(run(engine, requests)) == outputs(reference)
        assert engine.stats().num_accepted_tokens > 0
    jsonschema.validate(json.loads(reference["json"].outputs[0].text), PERSON)


def test_a_constraint_after_a_token_is_free_before_it_and_exact_under_speculation(tiny_llama) -> None:
    """StructuredOutput(after_token_id=T) (a reasoning model's answer after </think>):
    greedy, the output is the unconstrained one up to T's first appearance, then the
    regex's (Python's re holds the rest to it); the same with drafts, which are cut before
    T so that T is only ever sampled, and with speculation off."""
    import re
    prompt = [5, 9, 14, 27, 5, 9, 14, 27]
    free = run(tiny_engine(tiny_llama), {"f": (prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                                     ignore_eos=True))})["f"].outputs[0].token_ids
    start = free[2]
    first = free.index(start)  # where the constraint starts: after T's first appearance
    pattern = r"(ab|cd|[0-9]{2}){2,6}"
    params = SamplingParams(max_tokens=40, temperature=0.0, structured=StructuredOutput(regex=pattern,
                                                                                       after_token_id=start))
    reference = run(tiny_engine(tiny_llama), {"c": (prompt, params)})["c"].outputs[0]
    assert reference.token_ids[:first + 1] == free[:first + 1]
    engine = tiny_engine(tiny_llama)
    answer = engine.tokenizer.decode(reference.token_ids[first + 1:])
    assert re.fullmatch(pattern, answer), answer
    for speculative in ({"method": "draft", "model": str(tiny_llama), "num_speculative_tokens": 4,
                         "adaptive": False},
                        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}):
        engine = tiny_engine(tiny_llama, speculative_config=speculative)
        assert run(engine, {"c": (prompt, params)})["c"].outputs[0].token_ids == reference.token_ids
        assert engine.stats().num_draft_tokens > 0


def test_a_constraint_after_a_sequence_of_tokens_starts_where_the_output_first_ends_with_it(tiny_llama) -> None:
    """after_token_id as a sequence (GPT-OSS's <|channel|>final<|message|>): greedy, the
    output is the unconstrained one up to the sequence's first whole appearance (its first
    token alone starts nothing), then the regex's; the same with drafts, cut before the
    token that would complete it."""
    import re
    prompt = [5, 9, 14, 27, 5, 9, 14, 27]
    free = run(tiny_engine(tiny_llama), {"f": (prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                                     ignore_eos=True))})["f"].outputs[0].token_ids
    trigger = tuple(free[3:5])
    first = next(i for i in range(1, len(free)) if tuple(free[i - 1:i + 1]) == trigger)  # its last token's index
    pattern = r"(ab|cd|[0-9]{2}){2,6}"
    params = SamplingParams(max_tokens=40, temperature=0.0, structured=StructuredOutput(regex=pattern,
                                                                                       after_token_id=trigger))
    reference = run(tiny_engine(tiny_llama), {"c": (prompt, params)})["c"].outputs[0]
    assert reference.token_ids[:first + 1] == free[:first + 1]
    answer = tiny_engine(tiny_llama).tokenizer.decode(reference.token_ids[first + 1:])
    assert re.fullmatch(pattern, answer), answer
    engine = tiny_engine(tiny_llama, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                         "prompt_lookup_max": 2})
    assert run(engine, {"c": (prompt, params)})["c"].outputs[0].token_ids == reference.token_ids
    assert engine.stats().num_draft_tokens > 0
    with pytest.raises(ValueError, match="after_token_id must be a token id"):
        StructuredOutput(regex="a", after_token_id=())
