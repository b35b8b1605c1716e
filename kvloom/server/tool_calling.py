"""Tool calling in /v1/chat/completions: what a request's ``tools`` and ``tool_choice``
ask of the engine, and the model's output turned back into ``tool_calls``.

- ``tool_choice`` ``"none"``: the tools are rendered into the prompt, the answer is text.
- ``"auto"`` (the default when there are tools): the model chooses; with
  ``--enable-auto-tool-choice`` its output is parsed by ``--tool-call-parser`` into
  ``tool_calls`` (text that is no call stays ``content``); without it the answer is
  plain text. Where a tool is ``strict`` (or ``--tool-strict-level`` says so), every
  call the model opens is held to the format, and a strict tool's arguments to its
  schema (structured/tool_grammar.py ``auto_tool_call_constraint``), unless the request
  constrains its output itself (``response_format``, ``allowed_token_ids``).
- ``"required"`` or a named function: the grammar engine forces one call (or, with
  ``parallel_tool_calls``, one or more) in the parser's format, each call's arguments
  valid under the function's JSON schema (structured/tool_grammar.py), and the output
  is parsed back into ``tool_calls``.

A response with calls finishes with ``finish_reason: "tool_calls"`` (unless it was cut
by ``max_tokens``: ``"length"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvloom.server.errors import bad_request, from_value_error
from kvloom.server.protocol import ChatCompletionRequest
from kvloom.server.settings import ServerSettings
from kvloom.server.tool_call_stream import StreamDelta, StreamingToolParser
from kvloom.server.tool_parsers import DEFAULT_FORCED_FORMAT, ToolParser, get_tool_parser
from kvloom.structured.constraint import StructuredOutput
from kvloom.structured.tool_grammar import (
    InvalidTools,
    auto_tool_call_constraint,
    tool_call_constraint,
    tool_functions,
)


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What one request does with its tools."""

    tools: list[dict[str, Any]] | None  # rendered into the chat template
    parser: ToolParser | None = None  # parses the output into tool_calls (None: plain text)
    constraint: StructuredOutput | None = None  # the calls' grammar (see ``forced``)
    # True: the constraint is the output's whole grammar (a forced call, tool_choice
    # required / named; or, with strict tools and response_format, calls or that answer),
    # and another constraint on the output is an error; False: it holds the calls the
    # model chooses to make to their format (tool_choice auto with strict tools).
    forced: bool = False


def tool_use(body: ChatCompletionRequest, settings: ServerSettings) -> ToolUse:
    """The request's tool use; a 400 naming the field for malformed tools or a
    tool_choice that cannot be honoured."""
    tools = body.tools or None
    if tools is not None:
        try:
            tool_functions(tools)  # the grammar's own checks, so every tool_choice sees the same rules
        except InvalidTools as error:
            raise from_value_error(error) from None
    choice = body.tool_choice
    parallel = body.parallel_tool_calls is not False
    if choice is None or choice in ("none", "auto"):
        auto = tools is not None and choice != "none" and settings.enable_auto_tool_choice
        if not auto or settings.tool_call_parser is None:
            return ToolUse(tools)
        assert tools is not None
        try:
            constraint = auto_tool_call_constraint(tools, settings.tool_call_parser, settings.tool_strict_level,
                                                   parallel)
        except ValueError as error:
            raise bad_request(str(error), "tools") from None
        return ToolUse(tools, get_tool_parser(settings.tool_call_parser), constraint)
    if tools is None:
        raise bad_request(f"tool_choice {choice!r} needs tools to call", "tool_choice")
    parser_name = settings.tool_call_parser or DEFAULT_FORCED_FORMAT
    try:
        constraint = tool_call_constraint(tools, choice, parser_name, parallel=parallel)
    except ValueError as error:
        raise bad_request(str(error), "tool_choice") from None
    return ToolUse(tools, get_tool_parser(parser_name), constraint, forced=True)


def tool_finish_reason(finish_reason: str | None, num_calls: int) -> str | None:
    """OpenAI's finish_reason for an output that made ``num_calls`` calls."""
    return "tool_calls" if num_calls and finish_reason == "stop" else finish_reason


def message_with_calls(parser: ToolParser, text: str, finish_reason: str | None
                       ) -> tuple[dict[str, Any], str | None]:
    """A whole output as an assistant message (content and tool_calls) and its finish_reason."""
    content, calls = parser.parse(text)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    message = {"role": "assistant", "content": content, "tool_calls": [call.to_openai() for call in calls]}
    return message, tool_finish_reason(finish_reason, len(calls))


class StreamedCalls:
    """Parses the streamed outputs of a response, one parser per choice."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._streams: dict[int, StreamingToolParser] = {}

    def delta(self, index: int, text: str, finish_reason: str | None
              ) -> tuple[dict[str, Any], str | None]:
        """Choice ``index``'s next text delta (and, once finished, the rest) as a chunk's
        ``delta`` (content and tool_calls deltas) and its finish_reason."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = self.parser.stream()
        out = stream.feed(text) if text else StreamDelta()
        if finish_reason is not None:
            rest = stream.finish()
            out = StreamDelta(out.content + rest.content, out.tool_calls + rest.tool_calls)
            finish_reason = tool_finish_reason(finish_reason, stream.num_calls)
        delta: dict[str, Any] = {}
        if out.content:
            delta["content"] = out.content
        if out.tool_calls:
            delta["tool_calls"] = [call.to_openai() for call in out.tool_calls]
        return delta, finish_reason
