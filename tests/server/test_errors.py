"""Bad input -> the right status and OpenAI error shape; the server stays healthy and
leaks no KV blocks."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_harness import SERVED_NAME, LiveServer

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


BAD = "invalid_request_error"


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": SERVED_NAME, "messages": USER, "max_tokens": 2, **fields}


# (id, path, JSON body, expected status, expected error type, expected param)
CASES: list[tuple[str, str, Any, int, str, str | None]] = [
    ("max_tokens as string", COMPLETIONS, completion(max_tokens="5"), 400, BAD, "max_tokens"),
    ("negative max_tokens", COMPLETIONS, completion(max_tokens=-1), 400, BAD, "max_tokens"),
    ("zero max_tokens", CHAT, chat(max_tokens=0), 400, BAD, "max_tokens"),
    ("temperature < 0", COMPLETIONS, completion(temperature=-0.5), 400, BAD, "temperature"),
    ("temperature not a number", CHAT, chat(temperature="hot"), 400, BAD, "temperature"),
    ("top_p > 1", CHAT, chat(top_p=1.5), 400, BAD, "top_p"),
    ("presence_penalty > 2", CHAT, chat(presence_penalty=3), 400, BAD, "presence_penalty"),
    ("n = 0", COMPLETIONS, completion(n=0), 400, BAD, "n"),
    ("n too large", COMPLETIONS, completion(n=1000), 400, BAD, "n"),
    ("stream as string", CHAT, chat(stream="yes"), 400, BAD, "stream"),
    ("unknown field", COMPLETIONS, completion(foo=1), 400, BAD, "foo"),
    ("tool not a function", CHAT, chat(tools=[{"type": "retrieval"}]), 400, BAD, "tools[0]"),
    ("tool_choice required", CHAT, chat(tool_choice="required"), 400, BAD, "tool_choice"),
    ("tool_choice names no tool", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                             tool_choice={"type": "function", "function": {"name": "g"}}),
     400, BAD, "tool_choice"),
    ("tool_choice and response_format", CHAT,
     chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
          response_format={"type": "json_object"}), 400, BAD, "tool_choice"),
    ("response_format bad type", CHAT, chat(response_format={"type": "xml"}), 400,
     BAD, "response_format.type"),
    ("json schema false", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": False}}), 400, BAD, "response_format.json_schema.schema"),
    ("structured_outputs unknown key", CHAT, chat(structured_outputs={"foo": 1}), 400, BAD,
     "structured_outputs.foo"),
    ("empty stop string", COMPLETIONS, completion(stop=""), 400, BAD, "stop"),
    ("bad json schema", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}), 400, BAD, None),
    ("bad regex", COMPLETIONS, completion(guided_regex="[a-"), 400, BAD, None),
    ("two constraints", CHAT, chat(guided_regex="a+", guided_choice=["a"]), 400, BAD, None),
    ("logit_bias out of vocab", COMPLETIONS, completion(logit_bias={"1000000": 5}), 400, BAD,
     "logit_bias"),
    ("logit_bias > 100", CHAT, chat(logit_bias={"1": 101}), 400, BAD, "logit_bias"),
    ("logit_bias bad key", CHAT, chat(logit_bias={"a": 1}), 400, BAD, "logit_bias"),
    ("max_tokens and max_completion_tokens disagree", CHAT, chat(max_completion_tokens=3), 400,
     BAD, "max_completion_tokens"),
    ("store true", CHAT, chat(store=True), 400, BAD, "store"),
    ("prompt_logprobs streamed", COMPLETIONS, completion(prompt_logprobs=1, stream=True), 400, BAD,
     "prompt_logprobs"),
    ("prompt_logprobs above 20", COMPLETIONS, completion(prompt_logprobs=21), 400, BAD, "prompt_logprobs"),
    ("reasoning_effort not an effort", CHAT, chat(reasoning_effort="huge"), 400, BAD, "reasoning_effort"),
    ("null content without tool_calls", CHAT, chat(messages=[{"role": "user", "content": None}]),
     400, BAD, "messages[0]"),
    ("tool_calls on a user message", CHAT, chat(messages=[{"role": "user", "content": "x", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
     400, BAD, "messages[0]"),
    ("tool call arguments not JSON", CHAT, chat(messages=[{"role": "user", "content": "x"}, {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{\"city\": "}}]}]),
     400, BAD, "messages[1].tool_calls"),
    ("tool call arguments not an object", CHAT, chat(messages=[{"role": "user", "content": "x"}, {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}]}]),
     400, BAD, "messages[1].tool_calls"),
    ("template kwarg overrides messages", CHAT, chat(chat_template_kwargs={"messages": []}), 400,
     BAD, "chat_template_kwargs"),
    ("continue_final_message with add_generation_prompt", CHAT, chat(continue_final_message=True),
     400, BAD, "continue_final_message"),
    ("best_of", COMPLETIONS, completion(best_of=2), 400, BAD, "best_of"),
    ("suffix", COMPLETIONS, completion(suffix="x"), 400, BAD, "suffix"),
    ("empty messages", CHAT, chat(messages=[]), 400, BAD, "messages"),
    ("missing messages", CHAT, {"model": SERVED_NAME}, 400, BAD, "messages"),
    ("tool message without tool_call_id", CHAT, chat(messages=[{"role": "tool", "content": "x"}]),
     400, BAD, "messages[0]"),
    ("unknown role", CHAT, chat(messages=[{"role": "function", "content": "x"}]), 400,
     BAD, "messages[0].role"),
    ("image part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400,
     BAD, "messages[0].content"),
    ("empty prompt list", COMPLETIONS, completion(prompt=[]), 400, BAD, "prompt"),
    ("mixed prompt list", COMPLETIONS, completion(prompt=[1, "a"]), 400, BAD, "prompt"),
    ("empty prompt text", COMPLETIONS, completion(prompt=""), 400, BAD, "prompt"),
    ("token id out of vocab", COMPLETIONS, completion(prompt=[1, 10**6]), 400, BAD, "prompt"),
    ("prompt longer than context", COMPLETIONS, completion(prompt=[5] * 300), 400,
     BAD, "prompt"),
    ("prompt + max_tokens over context", COMPLETIONS, completion(prompt=[5] * 200, max_tokens=100), 400,
     BAD, "max_tokens"),
    ("logprobs > 20", COMPLETIONS, completion(logprobs=21), 400, BAD, "logprobs"),
    ("max_tokens 0 without echo", COMPLETIONS, completion(max_tokens=0), 400, BAD, "max_tokens"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, BAD, "top_logprobs"),
    ("top_logprobs past --max-logprobs", CHAT, chat(logprobs=True, top_logprobs=21), 400, BAD, "top_logprobs"),
    ("beams past --max-logprobs / 2", COMPLETIONS, completion(use_beam_search=True, n=11, temperature=0), 400,
     BAD, "n"),
    ("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), 400,
     BAD, "stream_options"),
    ("min_tokens > max_tokens", CHAT, chat(min_tokens=5), 400, BAD, "min_tokens"),
    ("unknown model", COMPLETIONS, completion(model="gpt-4"), 404, BAD, "model"),
    ("body not an object", COMPLETIONS, [1, 2], 400, BAD, None),
]


@pytest.fixture
def checked(live_server: LiveServer, http: httpx.Client) -> Iterator[httpx.Client]:
    yield http
    assert http.get("/health").status_code == 200
    live_server.assert_idle_and_clean()


def assert_error(response: httpx.Response, status: int, kind: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == kind and error["message"]
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("path, body, status, kind, param",
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_json_fields(checked: httpx.Client, path: str, body: Any, status: int, kind: str,
                         param: str | None) -> None:
    assert_error(checked.post(path, json=body), status, kind, param)


def test_sampling_params_message_passes_through(checked: httpx.Client) -> None:
    error = assert_error(checked.post(CHAT, json=chat(temperature=-1)), 400, "invalid_request_error")
    assert error["message"] == "temperature must be >= 0.0, got -1.0"


@pytest.mark.parametrize("raw", [b'{"prompt": "x",', b"not json", b""], ids=["truncated", "text", "empty"])
def test_malformed_json(checked: httpx.Client, raw: bytes) -> None:
    response = checked.post(COMPLETIONS, content=raw, headers={"content-type": "application/json"})
    assert_error(response, 400, "invalid_request_error")


@pytest.mark.parametrize("raw", [b'{"prompt": "\xff"}', gzip.compress(b'{"prompt": "x"}'), b"[" * 100_000],
                         ids=["not utf-8", "gzip", "deep nesting"])
def test_unreadable_bodies_say_why(checked: httpx.Client, raw: bytes) -> None:
    response = checked.post(COMPLETIONS, content=raw, headers={"content-type": "application/json"})
    error = assert_error(response, 400, "invalid_request_error")
    assert "UTF-8" in error["message"] and "compressed" in error["message"], error


def test_huge_body_with_content_length(checked: httpx.Client, live_server: LiveServer) -> None:
    body = b'{"prompt": "' + b"a" * (live_server.settings.max_body_bytes + 1) + b'"}'
    response = checked.post(COMPLETIONS, content=body, headers={"content-type": "application/json"})
    assert_error(response, 413, "invalid_request_error")


def test_huge_body_chunked(checked: httpx.Client, live_server: LiveServer) -> None:
    # No Content-Length: the limit is enforced while reading.
    def body() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(live_server.settings.max_body_bytes // 65536 + 2):
            yield b"a" * 65536
        yield b'"}'

    response = checked.post(COMPLETIONS, content=body(), headers={"content-type": "application/json"})
    assert_error(response, 413, "invalid_request_error")


def test_unknown_route_and_method(checked: httpx.Client) -> None:
    assert_error(checked.get("/v1/nope"), 404, "invalid_request_error")
    assert_error(checked.get(COMPLETIONS), 405, "invalid_request_error")


def test_errors_do_not_disturb_a_running_stream(checked: httpx.Client, live_server: LiveServer) -> None:
    body = completion(max_tokens=12, stream=True, temperature=0, ignore_eos=True)
    with httpx.Client(base_url=live_server.base_url, timeout=60) as other:
        with other.stream("POST", COMPLETIONS, json=body) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            for case in CASES[:8]:
                checked.post(case[1], json=case[2])
            rest = [line for line in lines if line.startswith("data:")]
    assert first and rest[-1] == "data: [DONE]"
    assert not any('"error"' in line for line in rest)


def test_openapi_documents_400_not_422_and_the_non_empty_rules(http) -> None:
    schema = http.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses and "400" in responses
        assert responses["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/OpenAIError"}
    request_schemas = schema["components"]["schemas"]
    assert request_schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    assert request_schemas["CompletionRequest"]["properties"]["prompt"]["minItems"] == 1
    assert http.post("/v1/chat/completions", json={"messages": []}).status_code == 400  # as documented
