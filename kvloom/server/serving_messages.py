"""POST /v1/messages: Anthropic's Messages API (as vLLM serves it), stateless, for text
and tools; POST /v1/messages/count_tokens.

A request is read as the chat request it amounts to (``to_chat_request``): ``system`` a
system message; a user message's ``tool_result`` blocks the tool messages they answer
(before its text), an assistant's ``tool_use`` blocks its tool_calls and its
``thinking`` blocks its reasoning; ``tools`` function tools, ``tool_choice`` auto / any
/ tool / none as chat's auto / required / a named function / none
(``disable_parallel_tool_use``: parallel_tool_calls false); ``stop_sequences`` stop;
``thinking`` the template's ``enable_thinking`` (an enabled one's ``budget_tokens``, with
``--reasoning-parser``, chat's ``thinking_token_budget``). The chat path's own pieces encode and
sample it. The answer's content blocks (a ``thinking`` block first with
``--reasoning-parser``, ``text``, and ``tool_use`` blocks where the tool parser finds
calls) are written by one ``_BlockWriter``, each opening when the output starts it;
streamed, that is Anthropic's events (``message_start``, ``content_block_start`` /
``_delta`` / ``_stop`` per block, ``message_delta``, ``message_stop``).

Errors have Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``,
errors.py ``anthropic_body``). ``cache_control`` hints are accepted and change nothing:
the radix cache keeps every prefix it can. Images, PDF / URL documents and server tools are refused
by name.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, ValidationError

from kvloom.engine.output import RequestOutput
from kvloom.server.async_engine import EngineFailed, RequestAborted, ResultStream
from kvloom.server.errors import APIError, bad_request, from_value_error
from kvloom.server.generation import (
    Serving,
    abort_on_disconnect,
    check_finished_cleanly,
    collect,
    engine_requests,
    open_with_kv_transfer,
)
from kvloom.server.protocol import ChatCompletionRequest, RequestModel
from kvloom.server.reasoning_parsers import get_reasoning_parser, reasoning_stream
from kvloom.server.responses import SSE_HEADERS
from kvloom.server.serving_chat import Reasoning, can_cap, encode_chat_request, params_and_tools, prepared_chat
from kvloom.server.settings import ServerSettings
from kvloom.server.tool_calling import ToolUse

logger = logging.getLogger(__name__)

# Chat's names for what the Messages request calls otherwise, for errors' `param`.
_PARAMS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "messages": "messages",
           "stop": "stop_sequences", "response_format": "output_config.format",
           "reasoning_effort": "output_config.effort"}


class MessagesRequest(RequestModel):
    """Anthropic's Messages request. Messages and their blocks are read block by block in
    ``_chat_messages``, so that an error names ``messages[i].content[j]``."""

    model: str
    messages: list[dict[str, Any]]
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # {"format": {"type": "json_schema", "schema": ...}, "effort": ...}: structured output,
    # and the template's reasoning_effort.
    output_config: dict[str, Any] | None = None
    # Accepted, no effect here: a prompt-caching hint (the radix cache keeps every prefix
    # it can anyway), the end user's id, and a priority tier.
    cache_control: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # Prefill/decode disaggregation, set by kvloom's router (as chat's field of that name).
    kv_transfer_params: dict[str, Any] | None = None


class CountTokensRequest(RequestModel):
    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


# ---- the request as chat -------------------------------------------------------------------
def _text_of(content: Any, where: str) -> str:
    """A string, or text blocks' texts concatenated (a tool result's, the system's)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", where)
    texts = []
    for index, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad_request(f"{where}[{index}]: only text blocks are supported here, got {kind!r}",
                              f"{where}[{index}]")
        texts.append(block["text"])
    return "".join(texts)


def _chat_messages(body: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.system is not None:
        messages.append({"role": "system", "content": _text_of(body.system, "system")})
    if not body.messages:
        raise bad_request("messages must not be empty", "messages")
    for index, message in enumerate(body.messages):
        where = f"messages[{index}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be user or assistant, got {role!r}", f"{where}.role")
        unknown = sorted(set(message) - {"role", "content"})
        if unknown:
            raise bad_request(f"{where} has unknown fields {unknown}", f"{where}.{unknown[0]}")
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise bad_request(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
        messages += _turn(role, blocks, f"{where}.content")
    return messages


def _turn(role: str, blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results (tool messages)
    before its text; an assistant's text, tool calls and reasoning as one message."""
    texts: list[str] = []
    results: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    thoughts: list[str] = []
    allowed = {"user": ("text", "tool_result", "document"),
               "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
    for index, block in enumerate(blocks):
        at = f"{where}[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed[role]:
            raise bad_request(f"{at}: {role} content blocks may be {', '.join(allowed[role])}; got {kind!r} "
                              "(images and server tools are not supported)", at)
        if kind == "text":
            texts.append(_field(block, "text", str, at))
        elif kind == "document":
            texts.append(_document_text(block, at))
        elif kind == "tool_result":
            content = block.get("content", "")
            results.append({"role": "tool", "tool_call_id": _field(block, "tool_use_id", str, at),
                            "content": _text_of(content, f"{at}.content")})
        elif kind == "tool_use":
            arguments = _field(block, "input", dict, at)
            calls.append({"id": _field(block, "id", str, at), "type": "function",
                          "function": {"name": _field(block, "name", str, at), "arguments": json.dumps(arguments)}})
        elif kind == "thinking":
            thoughts.append(_field(block, "thinking", str, at))
        # redacted_thinking: Anthropic's encrypted reasoning, opaque to any other model: dropped.
    if role == "user":
        return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning"] = "".join(thoughts)
    return [message]


def _document_text(block: dict[str, Any], where: str) -> str:
    """A text document as the model reads it: its title, its context and its text,
    separated by blank lines where given (a plain-text source's ``data``, or a content
    source's text blocks), and a blank line before whatever follows it in the turn. PDFs,
    URLs and files have no text here to read, and citations cannot be made: each refused
    by name."""
    source = _field(block, "source", dict, where)
    kind = source.get("type")
    if kind == "text":
        if source.get("media_type", "text/plain") != "text/plain":
            raise bad_request(f"{where}.source.media_type must be text/plain, got {source.get('media_type')!r}",
                              f"{where}.source.media_type")
        body = _field(source, "data", str, f"{where}.source")
    elif kind == "content":
        body = _text_of(source.get("content"), f"{where}.source.content")
    else:
        raise bad_request(f"{where}.source.type must be text or content (PDF, URL and file documents are not "
                          f"supported), got {kind!r}", f"{where}.source.type")
    citations = block.get("citations")
    if isinstance(citations, dict) and citations.get("enabled"):
        raise bad_request(f"{where}.citations: citations are not supported", f"{where}.citations")
    parts = [block.get(name) for name in ("title", "context")]
    for name, value in zip(("title", "context"), parts, strict=True):
        if value is not None and not isinstance(value, str):
            raise bad_request(f"{where}.{name} must be a string, got {value!r}", f"{where}.{name}")
    return "\n\n".join(part for part in (*parts, body) if part) + "\n\n"


def _field(block: dict[str, Any], name: str, kind: type, where: str) -> Any:
    value = block.get(name)
    if not isinstance(value, kind):
        raise bad_request(f"{where}.{name} must be a {kind.__name__}, got {value!r}", f"{where}.{name}")
    return value


def _chat_tools(body: MessagesRequest | CountTokensRequest) -> tuple[list[dict[str, Any]] | None, Any, bool | None]:
    """The tools, tool_choice and parallel_tool_calls in chat's shape."""
    tools = None
    if body.tools:
        tools = []
        for index, tool in enumerate(body.tools):
            where = f"tools[{index}]"
            if tool.get("type", "custom") != "custom" or not isinstance(tool.get("name"), str) \
                    or not isinstance(tool.get("input_schema"), dict):
                raise bad_request(f"{where}: only client tools ({{\"name\", \"description\", \"input_schema\"}}) are "
                                  "supported: server tools are Anthropic's", where)
            function = {"name": tool["name"], "parameters": tool["input_schema"]}
            for key in ("description", "strict"):
                if key in tool:
                    function[key] = tool[key]
            tools.append({"type": "function", "function": function})
    choice, parallel = body.tool_choice, None
    if choice is None:
        return tools, None, None
    kind = choice.get("type")
    if choice.get("disable_parallel_tool_use") is True:
        parallel = False
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice of type tool needs the tool's name", "tool_choice.name")
        return tools, {"type": "function", "function": {"name": choice["name"]}}, parallel
    chat_choice = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
    if chat_choice is None:
        raise bad_request(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", "tool_choice.type")
    return tools, chat_choice, parallel


def _template_kwargs(body: MessagesRequest | CountTokensRequest) -> dict[str, Any] | None:
    """``thinking`` as the template's ``enable_thinking`` (Qwen3's switch)."""
    if body.thinking is None:
        return None
    kind = body.thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad_request(f"thinking.type must be enabled, disabled or adaptive, got {kind!r}", "thinking.type")
    return {"enable_thinking": kind != "disabled"}


def thinking_budget(body: MessagesRequest | CountTokensRequest, settings: ServerSettings) -> int | None:
    """An enabled ``thinking``'s ``budget_tokens``, chat's ``thinking_token_budget``. None
    without a reasoning parser, or with one whose reasoning a budget cannot end
    (``can_cap``): Anthropic's clients send a budget with every enabled thinking, and where
    nothing marks a reasoning there is none to cap."""
    thinking = body.thinking or {}
    budget = thinking.get("budget_tokens")
    if budget is None or thinking.get("type") != "enabled":
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise bad_request(f"thinking.budget_tokens must be an integer >= 0, got {budget!r}", "thinking.budget_tokens")
    if settings.reasoning_parser is None or not can_cap(get_reasoning_parser(settings.reasoning_parser)):
        return None
    return budget


def _output_config(body: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """``output_config``: its ``format`` as chat's json_schema response_format, its
    ``effort`` as chat's reasoning_effort (the template's variable)."""
    config = body.output_config or {}
    unknown = sorted(set(config) - {"format", "effort"})
    if unknown:
        raise bad_request(f"output_config.{unknown[0]} is not supported (format and effort are)",
                          f"output_config.{unknown[0]}")
    fields: dict[str, Any] = {"reasoning_effort": config.get("effort")}
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise bad_request("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                              "output_config.format")
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return fields


def to_chat_request(body: MessagesRequest | CountTokensRequest, budget: int | None = None) -> ChatCompletionRequest:
    """The chat request ``body`` amounts to; ``budget``: its thinking budget
    (``thinking_budget``)."""
    tools, tool_choice, parallel = _chat_tools(body)
    fields: dict[str, Any] = {"model": body.model, "messages": _chat_messages(body), "tools": tools,
                              "tool_choice": tool_choice, "parallel_tool_calls": parallel,
                              "chat_template_kwargs": _template_kwargs(body), "thinking_token_budget": budget,
                              **_output_config(body)}
    if isinstance(body, MessagesRequest):
        fields |= {"max_completion_tokens": body.max_tokens, "stream": body.stream, "temperature": body.temperature,
                   "top_p": body.top_p, "top_k": body.top_k, "stop": body.stop_sequences}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:
        first = error.errors()[0]
        loc = [str(part) for part in first["loc"]]
        where = _PARAMS.get(loc[0], loc[0]) + "".join(f"[{part}]" if part.isdigit() else f".{part}"
                                                      for part in loc[1:2]) if loc else None
        raise bad_request(f"{where}: {first['msg']}", where) from None


# ---- the endpoints -------------------------------------------------------------------------
async def count_tokens(body: CountTokensRequest, serving: Serving) -> dict[str, int]:
    info = serving.model_info()
    serving.check_model(body.model, info)
    chat = to_chat_request(body)
    params_and_tools(chat, serving.settings, None, info)  # the tools checked as a message request's are
    return {"input_tokens": len(encode_chat_request(chat, info, serving.settings, chat.tools))}


async def create_message(body: MessagesRequest, request: Request, serving: Serving) -> Response:
    info = serving.model_info()
    model = serving.check_model(body.model, info)
    chat = to_chat_request(body, thinking_budget(body, serving.settings))
    try:
        params, tools, reasoning, prompt = prepared_chat(chat, serving.settings, info, "output_config.format")
        message_id = f"msg_{uuid.uuid4().hex}"
        stream = await open_with_kv_transfer(serving, request, engine_requests(
            message_id, [prompt], params, body.max_tokens, info, 0, "messages",
            lora=serving.lora_for(body.model, info)), body.kv_transfer_params, 1)
    except ValueError as error:
        raise from_value_error(error) from None
    if isinstance(stream, JSONResponse):  # the prefill leg of a disaggregated request, answered
        return stream
    shape = _Shape(message_id, model, tools, len(prompt), reasoning)
    if body.stream:
        return StreamingResponse(shape.events(stream, request), media_type="text/event-stream", headers=SSE_HEADERS)
    finals = await collect(stream, request)
    if stream.aborted:  # the client went away; nobody reads an answer
        raise APIError(499, "the client closed the connection", code="client_disconnected")
    return JSONResponse(shape.message(finals[0]))


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class _Shape:
    """The Message of one request, whole or as its stream of events."""

    def __init__(self, message_id: str, model: str, tools: ToolUse, prompt_len: int,
                 reasoning: Reasoning | None) -> None:
        self.id, self.model, self.tools, self.prompt_len = message_id, model, tools, prompt_len
        self.reasoning = reasoning  # --reasoning-parser: the output's reasoning is a thinking block

    def shell(self, content: list[dict[str, Any]], stop: tuple[StopReason | None, str | None],
              usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    def usage(self, final: RequestOutput | None, output_tokens: int) -> dict[str, int]:
        """Anthropic's split: input_tokens are those not read from the cache."""
        cached = 0 if final is None else final.num_cached_tokens
        return {"input_tokens": self.prompt_len - cached, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0, "output_tokens": output_tokens}

    @staticmethod
    def stop(final: RequestOutput, used_tools: bool) -> tuple[StopReason | None, str | None]:
        completion = final.outputs[0]
        if completion.finish_reason == "length":
            return "max_tokens", None
        if used_tools:
            return "tool_use", None
        if isinstance(completion.stop_reason, str):  # a stop string matched
            return "stop_sequence", completion.stop_reason
        return "end_turn", None

    def message(self, final: RequestOutput) -> dict[str, Any]:
        completion = final.outputs[0]
        writer = _BlockWriter(self)
        writer.feed(completion.text, finished=True)
        writer.close()
        return self.shell(writer.blocks, self.stop(final, writer.used_tools),
                          self.usage(final, len(completion.token_ids)))

    @staticmethod
    def event(kind: str, **fields: Any) -> str:
        data = {"type": kind, **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    async def events(self, stream: ResultStream, request: Request) -> AsyncIterator[str]:
        async with abort_on_disconnect(stream, request):
            try:
                yield self.event("message_start", message=self.shell([], (None, None), self.usage(None, 0)))
                writer = _BlockWriter(self)
                generated, final = 0, None
                async for _, output in stream:
                    if output.finished:
                        check_finished_cleanly(output)
                        final = output
                    generated += len(output.outputs[0].delta_token_ids)
                    for event in writer.feed(output.outputs[0].delta_text, output.finished):
                        yield event
                if stream.aborted or final is None:
                    return  # the client is gone
                for event in writer.close():
                    yield event
                reason, sequence = self.stop(final, writer.used_tools)
                yield self.event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                                 usage=self.usage(final, generated))
                yield self.event("message_stop")
            except (RequestAborted, APIError) as error:
                kind = "api_error" if isinstance(error, EngineFailed) or not isinstance(error, APIError) \
                    else "invalid_request_error"
                yield self.event("error", error={"type": kind, "message": str(error)})
            except Exception:  # noqa: BLE001 - a bug must end the stream, not hang it
                logger.exception("messages stream failed")
                yield self.event("error", error={"type": "api_error", "message": "internal server error"})


class _BlockWriter:
    """An output's content blocks and their events, one block open at a time: the
    reasoning opens a thinking block, text a text block (or continues the open one), a
    call's first delta a tool_use block; whatever opens next closes the one before.
    ``blocks`` are the closed ones, in order (a whole output is fed as one piece)."""

    def __init__(self, shape: _Shape) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.arguments = ""  # the open tool_use block's input, as JSON text so far
        self.used_tools = False
        self.parser = shape.tools.parser.stream() if shape.tools.parser is not None else None
        reasoning = shape.reasoning
        self.thinking = reasoning_stream(reasoning.format, reasoning.thinking) if reasoning is not None else None
        self.send_thinking = reasoning is not None and reasoning.included  # include_reasoning

    def feed(self, text: str, finished: bool) -> list[str]:
        events: list[str] = []
        if self.thinking is not None:
            thought, text = self.thinking.split(text, finished)
            if thought and self.send_thinking:
                events += self._delta("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                                      {"type": "thinking_delta", "thinking": thought}, "thinking", thought)
        if self.parser is None:
            return events + self._text(text)
        pieces = ([self.parser.feed(text)] if text else []) + ([self.parser.finish()] if finished else [])
        for piece in pieces:
            events += self._text(piece.content)
            for call in piece.tool_calls:
                if call.id is not None:  # a new call: its first delta names it
                    events += self._close()
                    self.used_tools = True
                    self.open, self.arguments = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}, ""
                    events.append(self._event("content_block_start", content_block=dict(self.open)))
                if call.arguments:
                    self.arguments += call.arguments
                    events.append(self._event("content_block_delta", delta={"type": "input_json_delta",
                                                                            "partial_json": call.arguments}))
        return events

    def _text(self, text: str) -> list[str]:
        if not text:
            return []
        return self._delta("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": text}, "text", text)

    def _delta(self, kind: str, start: dict[str, Any], delta: dict[str, Any], key: str, text: str) -> list[str]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            self.open = dict(start)
            events.append(self._event("content_block_start", content_block=start))
        self.open[key] += text
        events.append(self._event("content_block_delta", delta=delta))
        return events

    def close(self) -> list[str]:
        return self._close()

    def _close(self) -> list[str]:
        block, self.open = self.open, None
        if block is None:
            return []
        if block["type"] == "tool_use":
            try:
                arguments = json.loads(self.arguments or "{}")
            except json.JSONDecodeError:  # cut short by max_tokens
                arguments = {}
            block["input"] = arguments if isinstance(arguments, dict) else {}
        self.blocks.append(block)
        return [self._event("content_block_stop", index=len(self.blocks) - 1)]

    def _event(self, kind: str, index: int | None = None, **fields: Any) -> str:
        """An event of the open block (``index``: a closed one's)."""
        return _Shape.event(kind, index=len(self.blocks) if index is None else index, **fields)
