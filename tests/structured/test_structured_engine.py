"""Structured output inside the engine: batching with free requests, preemption,
jump-forward, stop conditions, prefix caching, and bad constraints at add_request."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from structured_helpers import (
    PERSON,
    SCHEMAS,
    SMALL,
    TICKET,
    chat_prompt,
    default_engine,
    default_llm,
    json_prompt,
    make_default_engine,
    run,
    steps_taken,
)

from kvloom import SamplingParams
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.structured import StructuredOutput


def tiny_engine(path, **kwargs) -> LLMEngine:
    args = dict(dtype="float32", block_size=8, num_blocks=512)
    args.update(kwargs)
    return LLMEngine(EngineConfig.from_kwargs(str(path), **args))


def texts(finals) -> dict[str, str]:
    return {request_id: output.outputs[0].text for request_id, output in finals.items()}


def test_unconstrained_requests_are_unaffected_by_constrained_neighbours(tiny_llama) -> None:
    rng = random.Random(5)
    free = {f"free-{i}": ([rng.randrange(3, 512) for _ in range(rng.randrange(5, 40))],
                          SamplingParams(max_tokens=rng.randrange(8, 30), temperature=0.0, ignore_eos=True))
            for i in range(6)}
    constrained = {f"json-{i}": ([rng.randrange(3, 512) for _ in range(20)], SamplingParams(
        max_tokens=80, temperature=0.0, structured=StructuredOutput(json_schema=SMALL))) for i in range(4)}
    alone_engine = tiny_engine(tiny_llama)
    alone = run(alone_engine, free)
    # The free-only batch never built a compiler, an executor or a single mask.
    assert alone_engine.runner.structured._compiler is None
    assert alone_engine.runner.structured._executor is None
    mixed = run(tiny_engine(tiny_llama), {**constrained, **free})
    for request_id in free:
        assert mixed[request_id].outputs[0].token_ids == alone[request_id].outputs[0].token_ids
    for request_id in constrained:
        assert mixed[request_id].outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(mixed[request_id].outputs[0].text), SMALL)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_preemption_keeps_tiny_model_outputs_identical(tiny_llama, prefix_cache: bool) -> None:
    rng = random.Random(9)
    requests = {f"r{i}": ([rng.randrange(3, 512) for _ in range(rng.randrange(20, 50))], SamplingParams(
        max_tokens=60, temperature=0.8, seed=i, structured=StructuredOutput(json_schema=SMALL)))
        for i in range(10)}
    reference = run(tiny_engine(tiny_llama, enable_prefix_caching=prefix_cache), requests)
    engine = tiny_engine(tiny_llama, num_blocks=24, enable_prefix_caching=prefix_cache)
    pressured = run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    assert texts(pressured) == texts(reference)
    assert engine.kv_manager.num_available_blocks == 24


def test_preemption_mid_generation_on_the_default_model() -> None:
    """A small pool forces recompute preemption in the middle of JSON generation; the
    matcher (asserted in sync with the output at every step) keeps outputs valid."""
    engine = make_default_engine(block_size=8, num_blocks=24, enable_prefix_caching=True)
    requests = {}
    for index, name in enumerate(("order", "book", "person", "weather", "order", "book", "order", "book")):
        schema, description = SCHEMAS[name]
        requests[f"{name}-{index}"] = (json_prompt(engine, description), SamplingParams(
            max_tokens=140, temperature=0.8, seed=index, structured=StructuredOutput(json_schema=schema)))
    finals = run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    # Preempted after its first token, i.e. in the middle of a structure.
    assert any(step > output.metrics.first_token_step
               for output in finals.values() for step in output.metrics.preempted_steps)
    for request_id, output in finals.items():
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (request_id, completion.text)
        jsonschema.validate(json.loads(completion.text), SCHEMAS[request_id.split("-")[0]][0])
    assert engine.kv_manager.num_available_blocks == 24


def test_jump_forward_saves_steps_and_keeps_greedy_output() -> None:
    engine = make_default_engine(dtype="float32", enable_prefix_caching=False, num_blocks=256)
    prompts = {f"t{i}": json_prompt(engine, description, TICKET)
               for i, description in enumerate(["a login bug", "a dark mode request",
                                                "a billing question", "a crash on start"])}

    def requests(jump_forward: bool):
        constraint = StructuredOutput(json_schema=TICKET, jump_forward=jump_forward)
        return {rid: (prompt, SamplingParams(max_tokens=64, temperature=0.0, structured=constraint))
                for rid, prompt in prompts.items()}

    steps_off, off = steps_taken(engine, requests(False))
    steps_on, on = steps_taken(engine, requests(True))
    assert texts(on) == texts(off)
    # Forced tokens are the canonical tokenization, which greedy decoding also picks here.
    assert {k: v.outputs[0].token_ids for k, v in on.items()} == \
        {k: v.outputs[0].token_ids for k, v in off.items()}
    for output in on.values():
        jsonschema.validate(json.loads(output.outputs[0].text), TICKET)
    # Keys, quotes and punctuation are forced: well under half the steps remain.
    assert steps_on < 0.6 * steps_off, (steps_on, steps_off)


@pytest.mark.parametrize("constraint, message", [
    (dict(json_schema={"type": "object", "properties": {"a": {"type": "strin"}}}), "Invalid type: strin"),
    (dict(json_schema={"type": "object", "if": {"required": ["a"]}}), 'Unimplemented keys: \\["if"\\]'),
    (dict(json_schema={"type": "integer", "minimum": 5, "maximum": 2}), "minimum .* greater than maximum"),
    (dict(regex="(unclosed"), "invalid regex"),
    (dict(grammar='root ::= "a" missing'), "invalid grammar: .*missing"),
])
def test_bad_constraints_fail_at_add_request(constraint, message) -> None:
    engine = default_engine()
    with pytest.raises(ValueError, match=message):
        engine.add_request(chat_prompt(engine, "hi"),
                           SamplingParams(structured=StructuredOutput(**constraint)), request_id="bad")
    assert not engine.has_unfinished_requests()
    assert engine.runner.structured.num_active == 0
    engine.check_integrity()
    assert engine.kv_manager.num_available_blocks == engine.num_blocks


def test_bad_constraint_in_a_batch_leaves_nothing_behind() -> None:
    llm = default_llm()
    good = SamplingParams(max_tokens=8, structured=StructuredOutput(regex="[a-z]+"))
    bad = SamplingParams(max_tokens=8, structured=StructuredOutput(regex="[z-a]"))
    with pytest.raises(ValueError, match="invalid regex"):
        llm.generate(["one", "two", "three"], [good, good, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.runner.structured.num_active == 0
    llm.engine.check_integrity()


def test_stop_string_inside_forced_tokens_trims_them() -> None:
    engine = default_engine()
    prompt = json_prompt(engine, "a person", PERSON)
    params = SamplingParams(max_tokens=64, temperature=0.0, stop=['"age'],
                            structured=StructuredOutput(json_schema=PERSON))
    completion = run(engine, {"stop": (prompt, params)})["stop"].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == '"age'
    assert completion.text.startswith('{"name":"') and completion.text.endswith(",")
    # The token completing the stop string is the last one; forced ones after it are gone.
    decode = engine.tokenizer.decode
    assert '"age' in decode(completion.token_ids) and '"age' not in decode(completion.token_ids[:-1])


def test_grammar_end_stops_even_with_ignore_eos_and_min_tokens() -> None:
    engine = default_engine()
    params = SamplingParams(max_tokens=30, min_tokens=20, ignore_eos=True, temperature=0.0,
                            structured=StructuredOutput(choice=["yes", "no"]))
    completion = run(engine, {"yn": (chat_prompt(engine, "Is water wet?"), params)})["yn"].outputs[0]
    assert completion.text in ("yes", "no") and completion.finish_reason == "stop"
    assert completion.token_ids[-1] in engine.eos_token_ids


def test_prefix_cache_serves_a_repeated_constrained_request() -> None:
    engine = default_engine()
    schema, description = SCHEMAS["ticket"]
    prompt = json_prompt(engine, description, schema)
    params = SamplingParams(max_tokens=64, temperature=0.0, structured=StructuredOutput(json_schema=schema))
    first = run(engine, {"a": (prompt, params)})["a"]
    second = run(engine, {"b": (prompt, params)})["b"]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].text == first.outputs[0].text
    jsonschema.validate(json.loads(second.outputs[0].text), schema)


def test_bench_function_reports_every_mode(tiny_llama) -> None:
    from kvloom.bench.structured import MODES, format_table, run_structured_bench

    results = run_structured_bench(tiny_engine(tiny_llama), num_prompts=2, max_tokens=12)
    assert [r.mode for r in results] == list(MODES)
    assert all(r.output_tokens > 0 and r.steps > 0 for r in results)
    assert results[0].num_valid is None and results[1].num_valid is not None
    assert "json+jump-forward" in format_table(results) and "tagged" in format_table(results)
    tagged = results[MODES.index("tagged")]
    assert tagged.num_valid is not None and 0 <= tagged.num_valid <= tagged.num_requests
