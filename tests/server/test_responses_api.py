"""POST /v1/responses (server/serving_responses.py) through the official OpenAI client on
the tiny model (fp32): the output text is transformers' greedy continuation of the chat
the request amounts to, streamed events assemble the same response, input items (text
parts, function calls and their outputs) become that chat, forced function calls and
json_schema formats hold, and what a stateless server cannot honour is a 400 naming it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import torch
from helpers_models import hf_greedy_tokens
from server_harness import SERVED_NAME, LiveServer

from kvloom.tokenizer import Tokenizer


def expected_text(http: httpx.Client, reference: torch.nn.Module, tokenizer: Tokenizer,
                  messages: list[dict[str, Any]], max_tokens: int) -> tuple[str, int, int]:
    """transformers' greedy reply to the chat (up to an EOS): its text, the prompt's
    length, and its number of tokens."""
    prompt = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    tokens = hf_greedy_tokens(reference, prompt, max_tokens)
    eos = set(tokenizer.eos_token_ids)
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokenizer.decode(tokens[:cut], skip_special_tokens=True), len(prompt), cut


def test_text_is_transformers_greedy_reply(client: Any, http: httpx.Client, live_server: LiveServer,
                                           reference: torch.nn.Module, tokenizer: Tokenizer) -> None:
    response = client.responses.create(model=SERVED_NAME, instructions="Be brief.", input="hello there",
                                       max_output_tokens=8, temperature=0)
    text, prompt_len, count = expected_text(http, reference, tokenizer, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}], 8)
    assert response.output_text == text
    assert response.status == ("incomplete" if count == 8 else "completed")
    assert response.usage.input_tokens == prompt_len and response.usage.output_tokens == min(count + 1, 8)
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.instructions == "Be brief." and response.max_output_tokens == 8
    live_server.assert_idle_and_clean()


def test_streamed_events_assemble_the_same_response(client: Any, live_server: LiveServer) -> None:
    kwargs = dict(model=SERVED_NAME, input="tell me something", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done",
                                       "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(event.delta for event in deltas) == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    live_server.assert_idle_and_clean()


def test_input_items_become_the_chat_they_stand_for(client: Any, http: httpx.Client, reference: torch.nn.Module,
                                                    tokenizer: Tokenizer) -> None:
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather in "},
                                                        {"type": "input_text", "text": "Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
        {"role": "user", "content": "thanks"},
    ]
    chat = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "thanks"}]
    response = client.responses.create(model=SERVED_NAME, input=items, max_output_tokens=6, temperature=0)
    text, prompt_len, _ = expected_text(http, reference, tokenizer, chat, 6)
    assert response.usage.input_tokens == prompt_len and response.output_text == text


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


def test_a_forced_function_call_is_a_function_call_item(client: Any, live_server: LiveServer) -> None:
    forced: dict[str, Any] = dict(model=SERVED_NAME, input="weather?", tools=[WEATHER], max_output_tokens=96,
                                  tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
                                  temperature=0)
    response = client.responses.create(**forced)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", response.output
    for call in calls:
        arguments = json.loads(call.arguments)
        assert set(arguments) == {"city"} and isinstance(arguments["city"], str) and len(arguments["city"]) <= 12
        assert call.call_id and call.id.startswith("fc_")
    # Streamed: the call's item opens, its arguments come as deltas, then it closes.
    streamed = list(client.responses.create(stream=True, **forced))
    kinds = [e.type for e in streamed]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in streamed] == list(range(len(streamed)))
    final = streamed[-1].response
    assert [(c.name, c.arguments) for c in final.output if c.type == "function_call"] == \
        [(c.name, c.arguments) for c in calls]
    for index, item in enumerate(final.output):
        mine = [e for e in streamed if getattr(e, "output_index", None) == index]
        assert mine[0].type == "response.output_item.added" and mine[-1].type == "response.output_item.done"
        assert mine[-1].item.id == item.id
        if item.type == "function_call":
            deltas = [e.delta for e in mine if e.type == "response.function_call_arguments.delta"]
            assert deltas and "".join(deltas) == item.arguments
            assert mine[-2].type == "response.function_call_arguments.done" and mine[-2].arguments == item.arguments
    live_server.assert_idle_and_clean()


def test_a_json_schema_format_holds(client: Any) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}},
              "required": ["answer"], "additionalProperties": False}
    response = client.responses.create(model=SERVED_NAME, input="answer in JSON", max_output_tokens=40, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    data = json.loads(response.output_text)
    assert set(data) == {"answer"} and len(data["answer"]) <= 8


@pytest.mark.parametrize("body, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": [{"type": "reasoning", "content": "thinking"}]}, "input[0]"),  # parts, not a string
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 10_000}, "max_output_tokens"),  # the context is 256
    ({"temperature": -1.0}, "temperature"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
    ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),  # effort: test_chat_template_fields.py
])
def test_what_a_stateless_server_cannot_honour_is_a_400(http: httpx.Client, live_server: LiveServer,
                                                        body: dict[str, Any], param: str) -> None:
    response = http.post("/v1/responses", json={"model": SERVED_NAME, "input": "hi", "max_output_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
    live_server.assert_idle_and_clean()


def test_items_open_and_close_in_the_order_the_output_writes_them() -> None:
    """The event writer on pieces given by hand: text, a call in three deltas, more text,
    then the end at max_output_tokens. Three items at output_index 0, 1, 2."""
    from kvloom.server.protocol import ResponsesRequest
    from kvloom.server.serving_responses import _ItemWriter, _Shape
    from kvloom.server.tool_call_stream import ToolCallDelta
    from kvloom.server.tool_calling import ToolUse

    shape = _Shape(ResponsesRequest(input="x"), "resp_1", "m", ToolUse(None, None), 3)
    writer = _ItemWriter(shape)
    raw = (writer.piece("Let me ", []) + writer.piece("check.", [ToolCallDelta(0, "", "call_a", "f")])
           + writer.piece("", [ToolCallDelta(0, '{"a": '), ToolCallDelta(0, "1}")]) + writer.piece("Done", [])
           + writer.close("length"))
    events = [json.loads(chunk.split("data: ", 1)[1]) for chunk in raw]
    assert [(e["type"], e["output_index"]) for e in events] == [
        ("response.output_item.added", 0), ("response.content_part.added", 0),
        ("response.output_text.delta", 0), ("response.output_text.delta", 0),
        ("response.output_text.done", 0), ("response.content_part.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.delta", 1), ("response.function_call_arguments.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.content_part.added", 2), ("response.output_text.delta", 2),
        ("response.output_text.done", 2), ("response.content_part.done", 2), ("response.output_item.done", 2)]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    first, call, last = writer.items
    assert (first["content"][0]["text"], first["status"]) == ("Let me check.", "completed")
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_a", "f", '{"a": 1}')
    assert (last["content"][0]["text"], last["status"]) == ("Done", "incomplete")  # cut by max_output_tokens
    assert len({first["id"], call["id"], last["id"]}) == 3


def test_a_responses_output_sent_back_as_input_continues_the_conversation(
        client: Any, live_server: LiveServer, tokenizer: Tokenizer) -> None:
    """The SDK's multi-turn pattern on a stateless server: the first response's output
    items (a function call) go back in the next input with the call's output; the
    prompt is the chat those items stand for."""
    first = client.responses.create(model=SERVED_NAME, input="weather?", tools=[WEATHER], max_output_tokens=96,
                                    tool_choice="required", parallel_tool_calls=False, temperature=0)
    call = next(item for item in first.output if item.type == "function_call")
    items = [{"role": "user", "content": "weather?"}, *[item.model_dump(exclude_none=True) for item in first.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = client.responses.create(model=SERVED_NAME, input=items, tools=[WEATHER], max_output_tokens=4,
                                     temperature=0)
    chat = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call.call_id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    from kvloom.server.protocol import ChatMessage
    tools = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    prompt = tokenizer.encode_chat([ChatMessage.model_validate(m).to_template() for m in chat], True, tools=tools)
    assert second.usage.input_tokens == len(prompt)
    live_server.assert_idle_and_clean()


def test_chat_path_errors_name_the_responses_fields() -> None:
    """An error the chat path raises about messages[k] names the item message k came
    from (instructions come first; consecutive function calls are one message)."""
    from kvloom.server.errors import APIError
    from kvloom.server.protocol import ResponsesRequest
    from kvloom.server.serving_responses import renamed, to_chat_request

    body = ResponsesRequest(instructions="be brief", input=[
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "a", "output": "1"}])
    chat, origins = to_chat_request(body)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert origins == ["instructions", "input[0]", "input[1]", "input[3]"]
    error = renamed(APIError(400, "the chat template cannot render messages[3]: no", param="messages[3]"), origins)
    assert (error.param, error.message) == ("input[3]", "the chat template cannot render input[3]: no")
    assert renamed(APIError(400, "m", param="max_tokens"), origins).param == "max_output_tokens"
    assert renamed(APIError(400, "m", param="response_format.json_schema"), origins).param == "text.format.json_schema"
    assert renamed(APIError(400, "m", param="temperature"), origins).param == "temperature"


def test_a_tools_strict_flag_reaches_the_chat_request() -> None:
    """OpenAI's "strict" on a Responses function tool (the SDK always sends it) and on an
    Anthropic tool carries to the chat tool, where tool_choice auto then holds the calls
    to the schema (tests/server/test_tool_calling.py)."""
    from kvloom.server.protocol import ResponsesRequest
    from kvloom.server.serving_messages import MessagesRequest
    from kvloom.server.serving_messages import to_chat_request as messages_to_chat
    from kvloom.server.serving_responses import to_chat_request

    chat, _ = to_chat_request(ResponsesRequest(model=SERVED_NAME, input="hi", tools=[{**WEATHER, "strict": True}]))
    assert chat.tools is not None and chat.tools[0]["function"]["strict"] is True
    anthropic = MessagesRequest(model=SERVED_NAME, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                tools=[{"name": "get_weather", "input_schema": WEATHER["parameters"], "strict": True}])
    assert messages_to_chat(anthropic).tools[0]["function"] == {
        "name": "get_weather", "parameters": WEATHER["parameters"], "strict": True}
