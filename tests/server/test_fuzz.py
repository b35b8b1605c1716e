"""Property-based fuzzing of every route (hypothesis): random request bodies built from
the real field names with values of every JSON type and range (huge and negative
numbers, infinities, unicode, nesting, unknown fields), sent to the live in-process
server on the tiny model. Never a 5xx but 503 (overloaded); after each body a normal
request is served, and the engine's block accounting balances."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import SERVED_NAME

FIELDS = {
    "/v1/completions": ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed",
                        "stop", "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
                        "ignore_eos", "min_tokens", "priority", "stream", "stream_options", "logprobs", "echo",
                        "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                        "user", "allowed_token_ids", "bad_words", "skip_special_tokens",
                        "include_stop_str_in_output", "truncate_prompt_tokens", "return_tokens_as_token_ids",
                        "cache_salt", "use_beam_search", "length_penalty", "return_token_ids"],
    "/v1/chat/completions": ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                             "n", "seed", "stop", "stream", "stream_options", "logprobs", "top_logprobs",
                             "response_format", "guided_choice", "guided_regex", "min_tokens", "stop_token_ids",
                             "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "cache_salt",
                             "use_beam_search", "length_penalty", "return_token_ids", "echo", "add_special_tokens",
                             "reasoning_effort", "documents", "chat_template", "include_reasoning", "request_id"],
    "/v1/responses": ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "tools",
                      "tool_choice", "parallel_tool_calls", "text", "store", "previous_response_id", "background",
                      "include", "truncation", "reasoning", "metadata", "user", "prompt_cache_key"],
    "/v1/embeddings": ["model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens",
                       "add_special_tokens", "cache_salt", "messages", "add_generation_prompt",
                       "continue_final_message", "chat_template_kwargs"],
    "/tokenize": ["model", "prompt", "messages", "add_generation_prompt", "add_special_tokens", "return_token_strs",
                  "continue_final_message", "documents", "chat_template"],
    "/detokenize": ["model", "tokens"],
    "/v1/messages": ["model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p",
                     "top_k", "tools", "tool_choice", "thinking", "output_config", "cache_control", "metadata"],
    "/v1/messages/count_tokens": ["model", "messages", "system", "tools", "tool_choice", "thinking"],
    "/score": ["model", "text_1", "text_2", "queries", "documents", "items", "data_1", "data_2",
               "truncate_prompt_tokens", "truncation_side", "max_tokens_per_query", "max_tokens_per_doc",
               "request_id", "priority", "use_activation", "instruction"],
    "/rerank": ["model", "query", "documents", "top_n", "truncate_prompt_tokens", "max_tokens_per_doc", "request_id"],
    # SageMaker's one route: a field of each route it dispatches to (and classify, a 400 on this model).
    "/invocations": ["model", "prompt", "messages", "input", "query", "documents", "text_1", "text_2", "max_tokens",
                     "temperature", "stream", "encoding_format", "top_n"],
    "/classify": ["model", "input", "messages", "truncate_prompt_tokens", "use_activation", "request_id", "priority"],
    "/pooling": ["model", "input", "messages", "task", "encoding_format", "use_activation", "truncate_prompt_tokens",
                 "request_id", "priority"],
}
# Counts that make a valid request expensive are kept small when they are valid; invalid
# values (negative, huge, wrong type) go through as generated.
SMALL = {"top_n": 3, "max_tokens_per_query": 8, "max_tokens_per_doc": 8,
         "max_tokens": 8, "max_completion_tokens": 8, "max_output_tokens": 8, "n": 3, "min_tokens": 4, "logprobs": 5,
         "top_logprobs": 5}

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
    st.sampled_from([0, 1, -1, 2 ** 63, 2 ** 64, 10 ** 6, 10 ** 30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30), st.sampled_from(["", "\u0000", "😀" * 3, "(a{1000}){1000}", "x" * 300]),
)
json_values = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=5), st.dictionaries(st.text(max_size=8), children, max_size=4)), max_leaves=12)
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-3, 3),
                   st.sampled_from([0.0, 1e-6, 1.0, 2.0, 1e308, -0.0]))
ints = st.one_of(st.integers(-3, 40), st.integers(-(2 ** 70), 2 ** 70), st.sampled_from([2 ** 63, 2 ** 64, -(2 ** 63)]))
plausible = {
    **{name: floats for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                 "repetition_penalty", "length_penalty")},
    **{name: ints for name in ("max_tokens", "max_completion_tokens", "max_output_tokens", "top_k", "n", "seed",
                               "min_tokens", "priority", "logprobs", "top_logprobs")},
    **{name: st.booleans() for name in ("ignore_eos", "stream", "echo", "add_generation_prompt",
                                        "add_special_tokens", "skip_special_tokens", "include_stop_str_in_output",
                                        "return_tokens_as_token_ids", "use_beam_search", "return_token_ids",
                                        "return_token_strs", "continue_final_message", "include_reasoning")},
    "reasoning_effort": st.sampled_from(["low", "high", "none", "huge", ""]),
    "documents": st.one_of(st.just([{"title": "t", "text": "x"}]), st.lists(st.integers(), max_size=2)),
    "chat_template": st.sampled_from(["{{ messages }}", "{% for %}", "x"]),  # untrusted here: 400s
    "request_id": st.sampled_from(["r1", "", "😀", "x" * 300]),
    "allowed_token_ids": st.lists(ints, max_size=4),
    "bad_words": st.lists(st.text(max_size=6), max_size=3),
    "truncate_prompt_tokens": ints,
    "cache_salt": st.sampled_from(["", "t1", "t2", "😀"]),
    "stop_token_ids": st.lists(ints, max_size=3),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}),
    "guided_regex": st.sampled_from(["[a-z]+", "(a{1000}){1000}", "(", "a*b?", ".{0,5}"]),
    "guided_grammar": st.sampled_from(["start: \"yes\" | \"no\"", "root ::= [a-z]+", "start: x", "::="]),
    "guided_json": st.sampled_from([{"type": "object"}, {"type": "integer"}, {"type": "bogus"}, "{}"]),
    "prompt": st.one_of(st.text(min_size=0, max_size=40), st.lists(st.integers(-5, 600), max_size=6),
                        st.lists(st.text(max_size=10), max_size=3)),
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]),
         "content": st.one_of(st.text(max_size=30), json_values, st.lists(st.fixed_dictionaries(  # Anthropic's blocks
             {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image"]),
              "text": st.text(max_size=8), "id": st.text(max_size=4), "name": st.text(max_size=4),
              "input": json_values, "tool_use_id": st.text(max_size=4), "content": json_values,
              "thinking": st.text(max_size=8)}), max_size=3))}), max_size=3),
    "tokens": st.lists(st.integers(-3, 600), max_size=6),
    # Anthropic's Messages API: blocks of every kind, tools and choices, right and wrong.
    "system": st.one_of(st.text(max_size=20), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image"]), "text": st.text(max_size=10)}), max_size=2)),
    "stop_sequences": st.lists(st.text(max_size=5), max_size=3),
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive", "x"]),
                                       "budget_tokens": ints}),
    "output_config": st.one_of(st.fixed_dictionaries({"effort": st.sampled_from(["low", "max", "x"])}),
                               st.fixed_dictionaries({"format": st.fixed_dictionaries(
                                   {"type": st.sampled_from(["json_schema", "x"]), "schema": json_values})})),
    "tool_choice": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"]),
                                                    "name": st.sampled_from(["get", "other"])}),
                             st.sampled_from(["auto", "required", "none"]), json_values),
    # Score and Rerank: texts, lists of texts, and what they are not.
    **{name: st.one_of(st.text(max_size=12), st.lists(st.text(max_size=8), max_size=3), json_values)
       for name in ("text_1", "text_2", "queries", "items", "data_1", "data_2", "query")},
    "truncation_side": st.sampled_from(["left", "right", "x"]),
    **{name: ints for name in ("max_tokens_per_query", "max_tokens_per_doc", "top_n")},
    "encoding_format": st.sampled_from(["float", "base64", "binary", ""]),
    "dimensions": ints,
    "input": st.one_of(st.text(max_size=30), st.lists(st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "developer", "x"]),
                               "content": st.one_of(st.text(max_size=20), json_values)}),
        st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output", "reasoning"]),
                               "call_id": st.text(max_size=5), "name": st.text(max_size=5),
                               "arguments": st.text(max_size=10), "output": json_values}),
        json_values), max_size=4)),
    "text": st.one_of(st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "x"]), "schema": json_values})}),
        json_values),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3)),
    "guided_choice": st.lists(st.text(min_size=0, max_size=6), max_size=4),
    "task": st.sampled_from(["embed", "classify", "token_embed", "token_classify", "encode", ""]),
    # vLLM's structural tags, well-formed and not: a format tree of a few nodes.
    "response_format": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["json_object", "text", "x"])}),
                                 st.fixed_dictionaries({"type": st.just("structural_tag"), "format": st.recursive(
                                     st.fixed_dictionaries({"type": st.sampled_from(["const_string", "any_text",
                                                                                     "regex", "x"]),
                                                            "value": st.text(max_size=4),
                                                            "pattern": st.sampled_from(["a+", "("])}),
                                     lambda inner: st.fixed_dictionaries({
                                         "type": st.sampled_from(["sequence", "or", "triggered_tags"]),
                                         "elements": st.lists(inner, max_size=3), "triggers": st.lists(
                                             st.text(max_size=3), max_size=2),
                                         "tags": st.lists(st.fixed_dictionaries({
                                             "type": st.just("tag"), "begin": st.text(max_size=4), "content": inner,
                                             "end": st.text(max_size=3)}), max_size=2)}), max_leaves=4)}),
                                 json_values),
}


BASES = {  # a valid body per route; each case changes a few of its fields or adds others
    "/v1/completions": {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 4},
    "/v1/chat/completions": {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}],
                             "max_tokens": 4},
    "/v1/responses": {"model": SERVED_NAME, "input": "Hi", "max_output_tokens": 4},
    "/v1/embeddings": {"model": SERVED_NAME, "input": ["Hello", "there"]},
    "/tokenize": {"model": SERVED_NAME, "prompt": "Hello"},
    "/detokenize": {"model": SERVED_NAME, "tokens": [5, 6, 7]},
    "/v1/messages": {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    "/v1/messages/count_tokens": {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}]},
    "/score": {"model": SERVED_NAME, "text_1": "Hi", "text_2": ["Hello", "there"]},
    "/rerank": {"model": SERVED_NAME, "query": "Hi", "documents": ["Hello", "there"]},
    "/invocations": {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 4},
    "/classify": {"model": SERVED_NAME, "input": "Hello"},
    "/pooling": {"model": SERVED_NAME, "input": ["Hello", "there"]},
}


@st.composite
def bodies(draw: Any) -> tuple[str, dict[str, Any]]:
    route = draw(st.sampled_from(sorted(FIELDS)))
    body: dict[str, Any] = dict(BASES[route])
    for name in draw(st.lists(st.sampled_from(FIELDS[route]), max_size=4, unique=True)):
        strategy = plausible.get(name, json_values) if draw(st.booleans()) else json_values
        value = draw(strategy)
        if name in SMALL and isinstance(value, int) and not isinstance(value, bool) and 0 < value < 10 ** 6:
            value = min(value, SMALL[name])
        body[name] = value
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(min_size=1, max_size=8))] = draw(json_values)  # an unknown field
    if draw(st.integers(0, 19)) == 0:
        body = draw(st.dictionaries(st.sampled_from(FIELDS[route]), json_values, max_size=6))  # anything
    return route, body


def encode(body: dict[str, Any]) -> bytes:
    # allow_nan: NaN / Infinity literals are not JSON, and a server must say so (400).
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


@pytest.fixture(scope="module")
def fuzz_http(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=60) as client:
        yield client


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(case=bodies())
def test_no_body_takes_the_server_down(live_server, fuzz_http, case) -> None:
    route, body = case
    response = fuzz_http.post(route, content=encode(body), headers={"Content-Type": "application/json"})
    assert response.status_code < 500 or response.status_code == 503, (route, body, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and "Traceback" not in error["message"]
    normal = fuzz_http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": "Hi", "max_tokens": 2})
    assert normal.status_code == 200, normal.text
    live_server.assert_idle_and_clean()  # check_integrity() on the engine thread, no block held

