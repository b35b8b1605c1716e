"""POST /v1/messages (server/serving_messages.py, Anthropic's Messages API) through the
official anthropic client on the tiny model (fp32): the text is transformers' greedy
reply to the chat the request amounts to, streamed events assemble the same message,
stop sequences and max_tokens end it as Anthropic reports, a forced tool call is a
tool_use block whose input validates, tool results and assistant tool calls render as
the equivalent chat does (count_tokens against /tokenize of that chat), text documents as
their title, context and text, and errors have Anthropic's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
import torch
from helpers_models import hf_greedy_tokens
from server_harness import SERVED_NAME, LiveServer

anthropic = pytest.importorskip("anthropic")  # in the test extras: never skipped by `make test`

# Closed (no other keys), short values: a random model's forced call ends soon.
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]
GREEDY = {"temperature": 0}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def claude(live_server: LiveServer) -> Iterator[Any]:
    with anthropic.Anthropic(base_url=live_server.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def greedy_reply(http: httpx.Client, reference: torch.nn.Module, messages: list[dict[str, Any]],
                 max_tokens: int) -> tuple[str, int, int]:
    """transformers' greedy reply to the chat (up to an EOS): its text, the prompt's
    length and its number of tokens (the EOS not counted)."""
    prompt = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    tokens = hf_greedy_tokens(reference, prompt, max_tokens)
    eos = {2}  # the tiny model's
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    text = http.post("/detokenize", json={"tokens": tokens[:cut]}).json()["prompt"]
    return text, len(prompt), cut


def test_text_is_transformers_greedy_reply(claude: Any, http: httpx.Client, live_server: LiveServer,
                                           reference: torch.nn.Module) -> None:
    # The SDK has no temperature argument any more; raw HTTP clients send it, as this does.
    message = claude.messages.create(model=SERVED_NAME, max_tokens=8, system="Be brief.", extra_body=GREEDY,
                                     messages=[{"role": "user", "content": "hello there"}])
    text, prompt_len, count = greedy_reply(http, reference, [{"role": "system", "content": "Be brief."},
                                                             {"role": "user", "content": "hello there"}], 8)
    assert message.type == "message" and message.role == "assistant" and message.model == SERVED_NAME
    assert [block.type for block in message.content] == ["text"] and message.content[0].text == text
    assert message.stop_reason == ("max_tokens" if count == 8 else "end_turn") and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt_len
    assert usage.output_tokens == min(count + 1, 8)
    live_server.assert_idle_and_clean()


def test_the_stream_assembles_the_same_message(claude: Any, live_server: LiveServer) -> None:
    request = dict(model=SERVED_NAME, max_tokens=12, extra_body=GREEDY,
                   messages=[{"role": "user", "content": "a story"}])
    whole = claude.messages.create(**request)
    with claude.messages.stream(**request) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    live_server.assert_idle_and_clean()


def test_a_stop_sequence_ends_it_and_is_named(claude: Any, http: httpx.Client, reference: torch.nn.Module) -> None:
    messages = [{"role": "user", "content": "count with me"}]
    text, _, _ = greedy_reply(http, reference, messages, 16)
    stop = next(text[i:i + 2] for i in range(2, len(text) - 1) if text[i:i + 2].strip())  # a piece inside it
    message = claude.messages.create(model=SERVED_NAME, max_tokens=16, extra_body=GREEDY, messages=messages,
                                     stop_sequences=[stop])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert message.content[0].text == text[:text.index(stop)]


def test_a_forced_tool_call_is_a_tool_use_block_whose_input_validates(claude: Any, live_server: LiveServer) -> None:
    for streamed in (False, True):
        request = dict(model=SERVED_NAME, max_tokens=96, tools=TOOLS, extra_body=GREEDY,
                       tool_choice={"type": "tool", "name": "get_weather"},
                       messages=[{"role": "user", "content": "weather in Paris?"}])
        if streamed:
            with claude.messages.stream(**request) as stream:
                message = stream.get_final_message()
        else:
            message = claude.messages.create(**request)
        calls = [block for block in message.content if block.type == "tool_use"]
        assert calls and message.stop_reason == "tool_use", message
        for call in calls:
            assert call.name == "get_weather" and call.id
            jsonschema.validate(call.input, WEATHER)
    live_server.assert_idle_and_clean()


def test_tool_use_and_tool_result_blocks_render_as_the_equivalent_chat(claude: Any, http: httpx.Client) -> None:
    conversation = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"},
            {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}}]},
    ]
    chat = [
        {"role": "system", "content": "You check the weather."},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    counted = claude.messages.count_tokens(model=SERVED_NAME, system="You check the weather.", tools=TOOLS,
                                           messages=conversation)
    expected = http.post("/tokenize", json={"messages": chat, "tools": CHAT_TOOLS}).json()["count"]
    assert counted.input_tokens == expected
    reply = claude.messages.create(model=SERVED_NAME, max_tokens=4, system="You check the weather.", tools=TOOLS,
                                   messages=conversation)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == expected


def test_a_text_document_is_read_as_its_title_context_and_text_before_the_question(claude: Any,
                                                                                    http: httpx.Client) -> None:
    """Plain-text and content sources render as the chat whose user turn holds the title,
    the context and the text, blank lines between, then the question (count_tokens against
    /tokenize of that chat); PDFs, URLs and citations are refused by name."""
    documents = [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Paris is sunny."},
         "title": "Forecast", "context": "From the morning paper."},
        {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "Rain in "},
                                                                          {"type": "text", "text": "Lyon."}]}},
        {"type": "text", "text": "Where is it sunny?"},
    ]
    chat = [{"role": "user", "content": "Forecast\n\nFrom the morning paper.\n\nParis is sunny.\n\n"
                                        "Rain in Lyon.\n\nWhere is it sunny?"}]
    counted = claude.messages.count_tokens(model=SERVED_NAME, messages=[{"role": "user", "content": documents}])
    assert counted.input_tokens == http.post("/tokenize", json={"messages": chat}).json()["count"]
    for source, field in (({"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}, "source.type"),
                          ({"type": "url", "url": "https://example.com/a.pdf"}, "source.type"),
                          ({"type": "text", "media_type": "text/html", "data": "<p>x</p>"}, "source.media_type")):
        refused = http.post("/v1/messages", json={"model": SERVED_NAME, "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "document", "source": source}, {"type": "text", "text": "?"}]}]})
        assert refused.status_code == 400 and field in refused.json()["error"]["message"], refused.text
    cited = http.post("/v1/messages", json={"model": SERVED_NAME, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{**documents[0], "citations": {"enabled": True}}]}]})
    assert cited.status_code == 400 and "citations are not supported" in cited.json()["error"]["message"]


@pytest.mark.parametrize("body, status, kind", [
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error"),  # no max_tokens
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, 400, "invalid_request_error"),
    ({"max_tokens": 4, "messages": []}, 400, "invalid_request_error"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "web_search_20250305",
                                                                                  "name": "web_search"}]},
     400, "invalid_request_error"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "model": "claude-opus"}, 404,
     "not_found_error"),
])
def test_errors_have_anthropics_shape(http: httpx.Client, live_server: LiveServer, body: dict[str, Any],
                                      status: int, kind: str) -> None:
    response = http.post("/v1/messages", json={"model": SERVED_NAME, **body})
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and error["error"]["message"]
    live_server.assert_idle_and_clean()


def test_the_sdk_raises_its_own_error_classes(claude: Any) -> None:
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=SERVED_NAME, max_tokens=4, messages=[{"role": "user", "content": ""}],
                               stop_sequences=[""])
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
