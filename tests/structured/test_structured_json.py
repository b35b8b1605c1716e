"""JSON schema outputs on the default model, sampled at temperature 0.8: every one parses
and validates, whatever the schema's shape (nested objects, arrays, enums, bounds)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from structured_helpers import SCHEMAS, default_engine, default_llm, json_prompt, run

from kvloom import SamplingParams
from kvloom.structured import StructuredOutput


def test_twenty_sampled_generations_validate_against_five_schemas() -> None:
    engine = default_engine()
    requests = {}
    for name, (schema, description) in SCHEMAS.items():
        for sample in range(4):
            params = SamplingParams(max_tokens=256, temperature=0.8, top_p=0.95, seed=100 + sample,
                                    structured=StructuredOutput(json_schema=schema))
            requests[f"{name}-{sample}"] = (json_prompt(engine, description, schema), params)
    compiled_before = engine.runner.structured.compiler(engine.tokenizer, engine.eos_token_ids).num_compiled
    finals = run(engine, requests)
    assert len(finals) == 20
    for request_id, output in finals.items():
        completion = output.outputs[0]
        schema = SCHEMAS[request_id.split("-")[0]][0]
        assert completion.finish_reason == "stop", (request_id, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)
    # Five schemas, twenty requests: each schema compiled at most once.
    compiler = engine.runner.structured.compiler(engine.tokenizer, engine.eos_token_ids)
    assert compiler.num_compiled - compiled_before <= 5


def test_json_object_with_n_samples() -> None:
    """n > 1 through LLM.chat (each sample gets seed + i): each is a JSON object, or a
    prefix of one reported as "length" when max_tokens cuts it."""
    llm = default_llm()
    params = SamplingParams(n=3, max_tokens=48, temperature=0.8, seed=7,
                            structured=StructuredOutput(json_object=True))
    messages = [{"role": "user", "content": "Give me a short JSON object with a cat's name and age."}]
    completions = llm.chat(messages, params, use_tqdm=False)[0].outputs
    assert len(completions) == 3
    # Sampled: a sample may wander into a long object; most close within the limit.
    assert sum(c.finish_reason == "stop" for c in completions) >= 1
    for completion in completions:
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)
        else:
            assert completion.finish_reason == "length" and completion.text.startswith("{")
    llm.engine.check_integrity()


@pytest.mark.parametrize("jump_forward", [True, False])
def test_max_tokens_cuts_structure_with_length(jump_forward: bool) -> None:
    engine = default_engine()
    schema, description = SCHEMAS["order"]
    params = SamplingParams(max_tokens=9, temperature=0.0, structured=StructuredOutput(
        json_schema=schema, jump_forward=jump_forward))
    completion = run(engine, {"cut": (json_prompt(engine, description, schema), params)})["cut"].outputs[0]
    assert completion.finish_reason == "length"
    assert len(completion.token_ids) == 9  # forced tokens never overshoot max_tokens
    with pytest.raises(json.JSONDecodeError):
        json.loads(completion.text)
