"""POST /v1/responses: OpenAI's Responses API, stateless, for text and function tools.

A request is read as the chat request it amounts to (``to_chat_request``: ``instructions``
a system message, ``input`` the messages, function calls and their outputs the assistant
tool calls and tool messages they are in chat, ``text.format`` the response_format,
``max_output_tokens`` max_completion_tokens), which the chat path's own pieces encode
and sample. The answer is a Response object whose items (a ``reasoning`` item of
``reasoning_text`` first with ``--reasoning-parser``, ``message`` items of
``output_text``, and ``function_call`` items where the tool parser finds calls) are
written by one ``_ItemWriter``, each opening when the output starts it. Streamed, that is
the Responses events (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``, numbered by ``sequence_number``). With ``--enable-responses-store``
a finished response is stored (``store``, true by default there, as OpenAI's) with its
conversation, which ``previous_response_id`` continues (server/response_store.py);
without it ``store: true`` and ``previous_response_id`` are 400s. ``background`` is a 400,
as are items and tools that only OpenAI's hosted tools could serve.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

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
from kvloom.server.protocol import ChatCompletionRequest, ResponsesRequest
from kvloom.server.reasoning_parsers import ReasoningStream
from kvloom.server.response_store import ResponseStore
from kvloom.server.responses import SSE_HEADERS
from kvloom.server.serving_chat import Reasoning, prepared_chat
from kvloom.server.tool_calling import ToolUse

logger = logging.getLogger(__name__)

# Chat's names for what the Responses request calls otherwise, for errors' `param`.
_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "messages": "input", "response_format": "text.format", "reasoning_effort": "reasoning.effort"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _item_error(where: str, message: str) -> APIError:
    return bad_request(f"{where}: {message}", where)


def _text_of(content: Any, where: str) -> str:
    """A message's content as one string: text, or its text parts concatenated."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _item_error(where, "content must be a string or a list of text parts")
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _item_error(f"{where}[{index}]", f"only text parts ({', '.join(_TEXT_PARTS)}) are supported, "
                                                  f"got {kind!r}")
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: ResponsesRequest) -> tuple[list[dict[str, Any]], list[str]]:
    """The chat messages of ``instructions`` and ``input`` (consecutive function calls
    become one assistant turn's tool_calls, as chat holds them), and where each came
    from (``instructions`` or ``input[i]``, its first item), for errors to name."""
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
        origins.append("instructions")
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    if not items:
        raise bad_request("input must not be empty", "input")
    # A reasoning item's text (an earlier output's, sent back), for the assistant turn it
    # led to: the next assistant message or calls, else an assistant turn of it alone.
    thought: tuple[str, str] | None = None  # (its text, where)

    def flush() -> None:
        nonlocal thought
        if thought is not None:
            messages.append({"role": "assistant", "content": "", "reasoning": thought[0]})
            origins.append(thought[1])
            thought = None

    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise _item_error(where, "an input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _item_error(f"{where}.role", f"must be user, assistant, system or developer, got {role!r}")
            message = {"role": role, "content": _text_of(item.get("content"), f"{where}.content")}
            if role == "assistant" and thought is not None:
                message["reasoning"], thought = thought[0], None
            flush()
            messages.append(message)
            origins.append(where)
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            thought = (text, where) if thought is None else (thought[0] + text, thought[1])
        elif kind == "function_call":
            fields = [item.get(name) for name in ("call_id", "name", "arguments")]
            if not all(isinstance(value, str) for value in fields):
                raise _item_error(where, "a function_call needs string call_id, name and arguments")
            call = {"id": fields[0], "type": "function", "function": {"name": fields[1], "arguments": fields[2]}}
            last = messages[-1] if messages else None
            if thought is None and last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if thought is not None:
                    message["reasoning"], thought = thought[0], None
                messages.append(message)
                origins.append(where)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise _item_error(where, "a function_call_output needs a string call_id")
            flush()
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(output, f"{where}.output")})
            origins.append(where)
        else:
            raise _item_error(where, f"input items of type {kind!r} are not supported here (messages, reasoning, "
                                     "function_call and function_call_output are)")
    flush()
    return messages, origins


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its reasoning_text parts (else its summary's texts)."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(part, dict) and isinstance(part.get("text"), str)
                                              for part in parts):
        raise _item_error(where, "a reasoning item's content (or summary) must be a list of parts with text")
    return "".join(part["text"] for part in parts)


def _chat_tools(body: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any] | None]:
    """The function tools and tool_choice in chat's shape."""
    tools = None
    if body.tools:
        tools = []
        for index, tool in enumerate(body.tools):
            if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
                raise _item_error(f"tools[{index}]", "only function tools ({\"type\": \"function\", \"name\", "
                                                     "\"parameters\"}) are supported: hosted tools are OpenAI's")
            function = {key: tool[key] for key in ("name", "description", "parameters") if key in tool}
            tools.append({"type": "function", "function": function})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                              "\"name\": ...}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's response_format (``text``: none)."""
    if text is None:
        return None
    fmt = text.get("format")
    if fmt is None or not isinstance(fmt, dict):
        raise bad_request("text must be {\"format\": {\"type\": ...}}", "text")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request(f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text.format")


def _refuse_stateful(body: ResponsesRequest, stores: bool) -> None:
    """400 for what needs stored responses where none are stored (``stores`` false), and
    for ``background``, ``include`` and truncation, which nothing here serves."""
    stateful = () if stores else (("store", body.store is True),
                                  ("previous_response_id", body.previous_response_id is not None))
    for name, given in stateful:
        if given:
            raise bad_request(f"{name} is not supported: this server stores no responses (it answers each request "
                              "on its own; send the conversation in input, or start it with "
                              "--enable-responses-store)", name, "unsupported_parameter")
    if body.background is True:
        raise bad_request("background is not supported: a response is answered while the request waits",
                          "background", "unsupported_parameter")
    if body.include:
        raise bad_request(f"include {body.include} is not supported (no hosted tools, no encrypted reasoning)",
                          "include", "unsupported_parameter")
    if body.truncation not in (None, "disabled"):
        raise bad_request("truncation must be \"disabled\": an input longer than the context is a 400", "truncation")


def _reasoning_effort(body: ResponsesRequest) -> str | None:
    """``reasoning.effort``, which becomes chat's ``reasoning_effort`` (the template's
    variable, as vLLM passes it). ``summary`` has no summarizer behind it here: the
    reasoning item carries the reasoning text itself, so only null is accepted."""
    if body.reasoning is None:
        return None
    for key, value in body.reasoning.items():
        if key in ("summary", "generate_summary") and value is not None:
            raise bad_request(f"reasoning.{key} is not supported: no summaries are written here (with "
                              "--reasoning-parser the reasoning item carries the reasoning text itself)",
                              f"reasoning.{key}", "unsupported_parameter")
        if key not in ("effort", "summary", "generate_summary"):
            raise bad_request(f"reasoning.{key} is not a reasoning field (effort, summary)", f"reasoning.{key}",
                              "unsupported_parameter")
    return body.reasoning.get("effort")


def to_chat_request(body: ResponsesRequest, stores: bool = False) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request the Responses request amounts to (400s name the Responses field),
    and where each of its messages came from (``_messages``); ``stores``: the server
    keeps responses."""
    _refuse_stateful(body, stores)
    tools, tool_choice = _chat_tools(body)
    messages, origins = _messages(body)
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream, "tools": tools,
        "tool_choice": tool_choice, "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text), "reasoning_effort": _reasoning_effort(body)}
    try:
        return ChatCompletionRequest.model_validate(fields), origins
    except ValidationError as error:
        first = error.errors()[0]
        loc = first["loc"]
        where = (origins[loc[1]] if len(loc) > 1 and loc[0] == "messages" and isinstance(loc[1], int)
                 else _PARAMS.get(str(loc[0]), str(loc[0])) if loc else None)
        raise bad_request(f"{where}: {first['msg']}", where) from None


def renamed(error: APIError, origins: list[str]) -> APIError:
    """A chat-path error with the Responses request's name for its field: ``messages[k]``
    becomes the item message k came from (``origins``), the rest by ``_PARAMS``."""
    if error.param is not None:
        head, dot, rest = error.param.partition(".")
        field, bracket, tail = head.partition("[")
        if field == "messages" and bracket and tail[:-1].isdigit() and int(tail[:-1]) < len(origins):
            error.message = error.message.replace(head, origins[int(tail[:-1])])
            error.param = origins[int(tail[:-1])] + dot + rest
        elif field in _PARAMS:
            error.param = _PARAMS[field] + bracket + tail + dot + rest
    return error


def _continued(body: ResponsesRequest, store: ResponseStore | None) -> tuple[ResponsesRequest, list[dict[str, Any]]]:
    """The request with its ``previous_response_id``'s conversation before its own input
    (404 for an id not stored), and its input as items (what a stored response keeps)."""
    items = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) \
        else list(body.input)
    if store is None or body.previous_response_id is None:
        return body, items
    previous = store.get(body.previous_response_id)
    if previous is None:
        raise APIError(404, f"Response with id '{body.previous_response_id}' not found.", param="previous_response_id",
                       code="response_not_found")
    items = [*previous.conversation, *items]
    return body.model_copy(update={"input": items}), items


async def create_response(body: ResponsesRequest, request: Request, serving: Serving) -> Response:
    info = serving.model_info()
    model = serving.check_model(body.model, info)
    origins: list[str] = []
    store = serving.responses
    try:
        body, input_items = _continued(body, store)
        chat, origins = to_chat_request(body, store is not None)
        params, tools, reasoning, prompt = prepared_chat(chat, serving.settings, info, "text.format")
        response_id = f"resp_{uuid.uuid4().hex}"
        stream = await open_with_kv_transfer(serving, request, engine_requests(
            response_id, [prompt], params, chat.effective_max_tokens, info, 0, "input",
            lora=serving.lora_for(body.model, info)), body.kv_transfer_params, 1)
    except APIError as error:
        raise renamed(error, origins) from None
    except ValueError as error:
        raise renamed(from_value_error(error), origins) from None
    if isinstance(stream, JSONResponse):  # the prefill leg of a disaggregated request, answered
        return stream
    kept = store is not None and body.store is not False  # stored unless the request says not
    shape = _Shape(body, response_id, model, tools, len(prompt), reasoning,
                   (lambda whole: store.put(whole, input_items)) if kept and store is not None else None)
    if body.stream:
        return StreamingResponse(shape.events(stream, request), media_type="text/event-stream", headers=SSE_HEADERS)
    finals = await collect(stream, request)
    if stream.aborted:  # the client went away; nobody reads an answer
        raise APIError(499, "the client closed the connection", code="client_disconnected")
    return JSONResponse(shape.finished(shape.response("completed", finals[0])))


def stored_response(response_id: str, serving: Serving, delete: bool = False) -> dict[str, Any]:
    """GET /v1/responses/{id}: the stored Response object; DELETE: it is forgotten (OpenAI's
    deletion object). 404 for an id not stored (or none stored at all)."""
    store = serving.responses
    stored = store.get(response_id) if store is not None else None
    if stored is None or store is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                       code="response_not_found")
    if delete:
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}
    return stored.response


class _Shape:
    """The Response object of one request, whole or as its stream of events."""

    def __init__(self, body: ResponsesRequest, response_id: str, model: str, tools: ToolUse, prompt_len: int,
                 reasoning: Reasoning | None = None,
                 store: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.body, self.id, self.model, self.tools, self.prompt_len = body, response_id, model, tools, prompt_len
        self.store = store  # keeps the finished response (--enable-responses-store), if it is to be kept
        # --reasoning-parser: the output's reasoning becomes a reasoning item, and the tokens
        # before the end marker's are counted as reasoning_tokens.
        self.reasoning = reasoning
        self.created_at = int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.sequence = 0

    # ---- the whole response ----------------------------------------------------------
    def response(self, status: str, final: RequestOutput | None, output: list[dict[str, Any]] | None = None,
                 token_ids: list[int] | None = None) -> dict[str, Any]:
        """The Response object: ``final``'s output items and usage once it has ended
        (``status`` then says how), an in-progress shell before. A streamed output's
        ``output`` items and ``token_ids`` are given (its final output is a delta)."""
        body = self.body
        data: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": status, "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "tools": body.tools or [], "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": body.text if body.text is not None else {"format": {"type": "text"}},
            "previous_response_id": body.previous_response_id, "store": self.store is not None,
            "truncation": "disabled",
            "reasoning": {"effort": body.reasoning.get("effort"), "summary": None} if body.reasoning else None,
            "metadata": body.metadata or {}, "user": body.user, "output": output or [], "usage": None}
        if final is not None:
            completion = final.outputs[0]
            if output is None:  # the whole text: its items as the stream would have written them
                writer = _ItemWriter(self)
                writer.feed(completion.text, finished=True)
                writer.close(completion.finish_reason)
                output = writer.items
            data["output"] = output
            if completion.finish_reason == "length":
                data["status"], data["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
            token_ids = list(completion.token_ids) if token_ids is None else token_ids
            generated = len(token_ids)
            data["usage"] = {
                "input_tokens": self.prompt_len, "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                "output_tokens": generated,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens(token_ids)},
                "total_tokens": self.prompt_len + generated}
        return data

    def finished(self, whole: dict[str, Any]) -> dict[str, Any]:
        """The finished Response object, stored where it is to be."""
        if self.store is not None:
            self.store(whole)
        return whole

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        return 0 if self.reasoning is None else self.reasoning.tokens(token_ids)

    def message_item(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [self.text_part(text)]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def text_part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    # ---- the stream of events --------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    async def events(self, stream: ResultStream, request: Request) -> AsyncIterator[str]:
        """created, in_progress, each output item as it is written (a message's text
        deltas; a function call's argument deltas, where the tool parser finds calls),
        then completed (or incomplete)."""
        async with abort_on_disconnect(stream, request):
            try:
                shell = self.response("in_progress", None)
                yield self.event("response.created", response=shell)
                yield self.event("response.in_progress", response=shell)
                writer = _ItemWriter(self)
                token_ids: list[int] = []
                final = None
                async for _, output in stream:
                    completion = output.outputs[0]
                    if output.finished:
                        check_finished_cleanly(output)
                        final = output
                    token_ids += completion.delta_token_ids
                    for event in writer.feed(completion.delta_text, output.finished):
                        yield event
                if stream.aborted or final is None:
                    return  # the client is gone
                for event in writer.close(final.outputs[0].finish_reason):
                    yield event
                whole = self.finished(self.response("completed", final, writer.items, token_ids))
                yield self.event("response.incomplete" if whole["status"] == "incomplete" else "response.completed",
                                 response=whole)
            except (RequestAborted, APIError) as error:
                if isinstance(error, APIError):
                    yield self.event("error", code=error.code, message=error.message, param=error.param)
                else:
                    code = "engine_failed" if isinstance(error, EngineFailed) else "request_aborted"
                    yield self.event("error", code=code, message=str(error), param=None)
            except Exception:  # noqa: BLE001 - a bug must end the stream, not hang it
                logger.exception("responses stream failed")
                yield self.event("error", code="internal_error", message="internal server error", param=None)


class _ItemWriter:
    """An output's items and their events, one item open at a time: text opens a message
    (or continues the open one), a call's first delta (from the tool parser, where the
    request has one) opens a function_call, and whatever opens next closes the one
    before. ``items`` are the closed ones, in order: what the Response holds, streamed
    or not (a whole output is fed as one piece, its events unsent)."""

    def __init__(self, shape: _Shape) -> None:
        self.shape = shape
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.parser = shape.tools.parser.stream() if shape.tools.parser is not None else None
        reasoning = shape.reasoning
        self.thinking = (ReasoningStream(reasoning.format, reasoning.thinking)
                         if reasoning is not None and reasoning.thinking else None)

    def feed(self, text: str, finished: bool) -> list[str]:
        """The events of the output's next text (``finished``: its last): the reasoning
        first (a reasoning item), then the content after it, as the tool parser reads it."""
        events: list[str] = []
        if self.thinking is not None:
            thought, text = self.thinking.split(text, finished)
            events = self.reason(thought)
        return events + self.content(text, finished)

    def reason(self, text: str) -> list[str]:
        """A reasoning item's next text (the first item: the reasoning comes first)."""
        if not text:
            return []
        events = []
        if self.open is None:
            self.open = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                         "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
            events.append(self._event("response.output_item.added", item={**self.open, "content": []}))
            events.append(self._event("response.content_part.added", item_id=self.open["id"], content_index=0,
                                      part={"type": "reasoning_text", "text": ""}))
        assert self.open["type"] == "reasoning", "reasoning after the answer began"
        self.open["content"][0]["text"] += text
        events.append(self._event("response.reasoning_text.delta", item_id=self.open["id"], content_index=0,
                                  delta=text))
        return events

    def content(self, text: str, finished: bool) -> list[str]:
        if self.parser is None:
            return self.text(text)
        pieces = ([self.parser.feed(text)] if text else []) + ([self.parser.finish()] if finished else [])
        return [event for piece in pieces for event in self.piece(piece.content, piece.tool_calls)]

    def text(self, text: str) -> list[str]:
        if not text:
            return []
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self._close("completed")
            self.open = self.shape.message_item("", "in_progress")
            self.open["id"] = f"msg_{uuid.uuid4().hex}" if self.items else self.shape.message_id
            events.append(self._event("response.output_item.added", item={**self.open, "content": []}))
            events.append(self._event("response.content_part.added", item_id=self.open["id"], content_index=0,
                                      part=_Shape.text_part("")))
        self.open["content"][0]["text"] += text
        events.append(self._event("response.output_text.delta", item_id=self.open["id"], content_index=0,
                                  delta=text, logprobs=[]))
        return events

    def piece(self, content: str, calls: list[Any]) -> list[str]:
        """What the tool parser made of a delta: content text, then call deltas."""
        events = self.text(content)
        for call in calls:
            if call.id is not None:  # a new call: its first delta names it
                events += self._close("completed")
                self.open = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id,
                             "name": call.name, "arguments": "", "status": "in_progress"}
                events.append(self._event("response.output_item.added", item=dict(self.open)))
            assert self.open is not None and self.open["type"] == "function_call", "call arguments before the call"
            if call.arguments:
                self.open["arguments"] += call.arguments
                events.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                          delta=call.arguments))
        return events

    def close(self, finish_reason: str | None) -> list[str]:
        """The end: the open item closes (a message cut by max_output_tokens as
        incomplete); an output with no item at all is one empty message."""
        if self.open is None and not self.items:
            self.open = self.shape.message_item("", "in_progress")
            events = [self._event("response.output_item.added", item={**self.open, "content": []}),
                      self._event("response.content_part.added", item_id=self.open["id"], content_index=0,
                                  part=_Shape.text_part(""))]
            return events + self._close("incomplete" if finish_reason == "length" else "completed")
        return self._close("incomplete" if finish_reason == "length" else "completed")

    def _close(self, status: str) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status if item["type"] in ("message", "reasoning") else "completed"
        if item["type"] == "reasoning":
            part = item["content"][0]
            events = [self._event("response.reasoning_text.done", item_id=item["id"], content_index=0,
                                  text=part["text"]),
                      self._event("response.content_part.done", item_id=item["id"], content_index=0, part=part)]
        elif item["type"] == "message":
            part = item["content"][0]
            events = [self._event("response.output_text.done", item_id=item["id"], content_index=0, text=part["text"],
                                  logprobs=[]),
                      self._event("response.content_part.done", item_id=item["id"], content_index=0, part=part)]
        else:
            events = [self._event("response.function_call_arguments.done", item_id=item["id"],
                                  arguments=item["arguments"])]
        self.items.append(item)
        return events + [self._event("response.output_item.done", item=item, index=len(self.items) - 1)]

    def _event(self, kind: str, index: int | None = None, **fields: Any) -> str:
        """An event of the open item (``index``: a closed one's) at its output_index."""
        return self.shape.event(kind, output_index=len(self.items) if index is None else index, **fields)
