"""Tool-call parsers: model output text -> OpenAI ``tool_calls`` plus the remaining content.

One parser per output format, registered by vLLM's ``--tool-call-parser`` names:

* ``hermes`` (SmolLM2, Qwen): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated;
* ``llama3_json``: ``{"name": ..., "parameters": {...}}`` at the start of the output, optionally
  after ``<|python_tag|>``, several separated by ``;``;
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``;
* ``openai`` (GPT-OSS, with ``--reasoning-parser openai_gptoss``, which leaves a harmony
  message addressed to a function in the content whole): ``<|start|>assistant<|channel|>
  commentary to=functions.NAME <|constrain|>json<|message|>{...}``, the recipient in the
  header wherever it stands, the arguments the body's JSON object.

Every format is parsed by one incremental state machine (``StreamingToolParser``);
``parse(text)`` is that machine fed the whole text at once, so streaming, whatever the
split points, concatenates to exactly the non-streaming result. The machine emits text
as content as soon as it cannot be (the start of) a call, holds back the rest, and
emits a call once its text is complete and valid. Rules the formats share:

* a call whose text is malformed (invalid JSON, no string ``name``, ``arguments`` not an
  object) is content, verbatim, markers included; parsing never raises;
* whitespace-only text after a valid call (between calls, at the end) is dropped;
* ``arguments`` is re-serialised with ``json.dumps(..., ensure_ascii=False)``;
  a call without arguments gets ``"{}"``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from kvloom.server.tool_call_stream import (
    JsonValueEnd,
    StreamDelta,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    call_fields,
    calls_from_deltas,
    held_marker_prefix,
    json_value_end,
    loads_or_none,
    mistral_call_id,
    openai_call_id,
)

__all__ = ["DEFAULT_FORCED_FORMAT", "TOOL_PARSERS", "JsonValueEnd", "StreamDelta", "StreamingToolParser",
           "ToolCall", "ToolCallDelta", "ToolParser", "calls_from_deltas", "get_tool_parser", "json_value_end"]


class _MarkerParser(StreamingToolParser):
    """Content, with calls that each begin at ``start_marker`` (Hermes, Mistral).

    States: ``content`` (looking for the marker), ``call`` (the marker consumed, the
    call's text accumulating in the buffer). After a valid call, whitespace is held
    until non-whitespace shows it is content, or a marker / the end drops it.
    """

    start_marker: ClassVar[str]

    def __init__(self, make_id: Callable[[], str]) -> None:
        super().__init__(make_id)
        self._in_call = False
        self._after_call = False

    def _step(self, final: bool) -> bool:
        return self._step_call(final) if self._in_call else self._step_content(final)

    def _step_content(self, final: bool) -> bool:
        buffer = self._buffer
        found = buffer.find(self.start_marker)
        if found >= 0:
            segment_end = found
        elif final:
            segment_end = len(buffer)
        else:
            segment_end = len(buffer) - held_marker_prefix(buffer, self.start_marker)
        segment = buffer[:segment_end]
        if self._after_call:
            if segment.strip() == "":
                if found < 0 and not final:
                    return False  # maybe whitespace between calls: hold it
                self._buffer = buffer[segment_end:]
                self._after_call = False
                return bool(self._buffer)
            self._after_call = False
        self._content(segment)
        if found >= 0:
            self._buffer = buffer[found + len(self.start_marker):]
            self._in_call = True
            return True
        self._buffer = buffer[segment_end:]
        return False

    def _step_call(self, final: bool) -> bool:
        end = self._call_end(self._buffer, final)
        if end is None:
            if not final:
                return False
            end = len(self._buffer)
        body, self._buffer = self._buffer[:end], self._buffer[end:]
        self._in_call = False
        self._json_end = None
        calls = self._decode(body)
        if calls is None:
            self._content(self.start_marker + body)
        else:
            for name, arguments in calls:
                self._call(name, arguments)
            self._after_call = True
        return True

    def _call_end(self, text: str, final: bool) -> int | None:
        """End of the call's text after the marker (None: not complete yet)."""
        raise NotImplementedError

    def _decode(self, body: str) -> list[tuple[str, str]] | None:
        """The (name, arguments) of the call's text, or None if it is malformed."""
        raise NotImplementedError


class _HermesStream(_MarkerParser):
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def _call_end(self, text: str, final: bool) -> int | None:
        found = text.find(self.end_marker)
        return None if found < 0 else found + len(self.end_marker)

    def _decode(self, body: str) -> list[tuple[str, str]] | None:
        # An unterminated call at the very end (the model stopped on the end marker)
        # is accepted when its JSON is complete.
        if body.endswith(self.end_marker):
            body = body[:-len(self.end_marker)]
        fields = call_fields(loads_or_none(body), ("arguments",))
        return None if fields is None else [fields]


class _MistralStream(_MarkerParser):
    start_marker = "[TOOL_CALLS]"

    def _call_end(self, text: str, final: bool) -> int | None:
        stripped = text.lstrip()
        if not stripped:
            return None
        if stripped[0] not in "[{":
            return 0  # malformed: the marker alone becomes content
        return self._scan_json(len(text) - len(stripped))

    def _decode(self, body: str) -> list[tuple[str, str]] | None:
        value = loads_or_none(body) if body.strip() else None
        items = value if isinstance(value, list) else [value]
        calls = [call_fields(item, ("arguments", "parameters")) for item in items]
        if not calls or any(call is None for call in calls):
            return None
        return [call for call in calls if call is not None]


_HARMONY_HEADERS = ("<|start|>", "<|channel|>")  # where a harmony message's header may begin
_HARMONY_MESSAGE = "<|message|>"
_HARMONY_ENDS = ("<|call|>", "<|end|>")
_HARMONY_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")


class _HarmonyStream(StreamingToolParser):
    """Content, with calls that are harmony messages (GPT-OSS): a header from ``<|start|>``
    or ``<|channel|>`` to ``<|message|>`` naming the recipient ``functions.NAME``, then the
    arguments' JSON object and, where the text has it, the ``<|call|>`` (or ``<|end|>``)
    that ends the message. A message that names no function, or whose body is no JSON
    object, is content verbatim, markup included."""

    def __init__(self, make_id: Callable[[], str]) -> None:
        super().__init__(make_id)
        self._in_call = False
        self._after_call = False  # whitespace after a valid call is held, then dropped
        self._arguments_end: int | None = None  # where the pending call's JSON ends, once found

    def _step(self, final: bool) -> bool:
        buffer = self._buffer
        if not self._in_call:
            found = [index for marker in _HARMONY_HEADERS if (index := buffer.find(marker)) >= 0]
            if found:
                end = min(found)
            else:
                end = len(buffer) if final else len(buffer) - max(held_marker_prefix(buffer, m)
                                                                    for m in _HARMONY_HEADERS)
            if self._after_call and not buffer[:end].strip():
                if not found and not final:
                    return False  # maybe whitespace between calls: hold it
            else:
                self._content(buffer[:end])
            self._after_call = False  # the whitespace dropped, or the text emitted
            self._buffer, self._in_call = buffer[end:], bool(found)
            return bool(found)
        header_end = buffer.find(_HARMONY_MESSAGE)
        end: int | None = None
        if header_end >= 0:
            body = header_end + len(_HARMONY_MESSAGE)
            stripped = buffer[body:].lstrip()
            if stripped[:1] not in ("", "{"):
                end = len(buffer)  # no JSON object: the rest is this malformed message's text
            elif self._arguments_end is not None:
                end = self._arguments_end
            elif stripped:
                end = self._arguments_end = self._scan_json(len(buffer) - len(stripped))  # kept: a scan resumes past it
            if end is not None:
                marker = next((m for m in _HARMONY_ENDS if buffer.startswith(m, end)), None)
                if marker is not None:
                    end += len(marker)
                elif not final and any(m.startswith(buffer[end:]) for m in _HARMONY_ENDS):
                    end = None  # the end marker may still come
        if end is None:
            if not final:
                return False
            end = len(buffer)
        message, self._buffer = buffer[:end], buffer[end:]
        self._in_call, self._json_end, self._arguments_end = False, None, None
        call = self._decode(message)
        if call is None:
            self._content(message)
        else:
            self._call(*call)
        self._after_call = call is not None
        return True

    @staticmethod
    def _decode(message: str) -> tuple[str, str] | None:
        header, found, body = message.partition(_HARMONY_MESSAGE)
        recipient = _HARMONY_RECIPIENT.search(header)
        for marker in _HARMONY_ENDS:
            body = body.removesuffix(marker)
        arguments = loads_or_none(body) if found and body.strip() else None
        if recipient is None or not isinstance(arguments, dict):
            return None
        return recipient.group(1), json.dumps(arguments, ensure_ascii=False)


_PYTHON_TAG = "<|python_tag|>"
_LEADING = re.compile(r"\s*(?:<\|python_tag\|>)?\s*")
_SEPARATOR = re.compile(r"\s*(;\s*)?")


class _Llama3JsonStream(StreamingToolParser):
    """Calls only at the start of the output: ``[<|python_tag|>] {call} (; {call})*``.
    Anything else, from the first thing that is not a valid call, is content verbatim
    (the whole output when there is no valid call)."""

    def __init__(self, make_id: Callable[[], str]) -> None:
        super().__init__(make_id)
        self._state = "start"  # start -> (calls <-> between) -> content

    def _step(self, final: bool) -> bool:
        buffer = self._buffer
        if self._state == "content":
            self._content(buffer)
            self._buffer = ""
            return False
        if self._state == "start":
            return self._step_start(buffer, final)
        # Between calls: "; {next call}", or whitespace (and a dangling ';') to the end.
        separator = _SEPARATOR.match(buffer)
        assert separator is not None  # the pattern matches the empty string
        if separator.end() == len(buffer):
            if final:
                self._buffer = ""
            return False
        if separator.group(1) is not None and buffer[separator.end()] == "{":
            return self._object(separator.end(), final)
        self._state = "content"
        return True

    def _step_start(self, buffer: str, final: bool) -> bool:
        leading = _LEADING.match(buffer)
        assert leading is not None  # the pattern matches the empty string
        rest = buffer[leading.end():]
        if rest.startswith("{"):
            return self._object(leading.end(), final)
        # Undecided while the text so far is whitespace, maybe a partial tag, whitespace.
        undecided = rest == "" or (_PYTHON_TAG not in buffer and _PYTHON_TAG.startswith(rest))
        if undecided and not final:
            return False
        self._state = "content"
        return True

    def _object(self, start: int, final: bool) -> bool:
        end = self._scan_json(start)
        if end is None and not final:
            return False
        self._json_end = None
        fields = None if end is None else call_fields(
            loads_or_none(self._buffer[start:end]), ("parameters", "arguments"))
        if fields is None or end is None:
            self._state = "content"
            return True
        self._call(*fields)
        self._buffer = self._buffer[end:]
        self._state = "between"
        return True


@dataclass(frozen=True, slots=True)
class ToolParser:
    """A registered format: ``parse`` whole outputs, ``stream()`` one streamed output."""

    name: str
    stream_class: type[StreamingToolParser]
    make_id: Callable[[], str] = openai_call_id
    # Its marker is a special token in the model's tokenizer (Mistral's [TOOL_CALLS]): an
    # output it reads is decoded with the special tokens, as vLLM's parser asks.
    special_marker: bool = False

    def stream(self, make_id: Callable[[], str] | None = None) -> StreamingToolParser:
        return self.stream_class(make_id or self.make_id)

    def parse(self, text: str, make_id: Callable[[], str] | None = None) -> tuple[str | None, list[ToolCall]]:
        """(content or None when there is none, calls) of a complete output."""
        stream = self.stream(make_id)
        deltas = [stream.feed(text), stream.finish()]
        content = "".join(delta.content for delta in deltas)
        return content or None, calls_from_deltas(delta for out in deltas for delta in out.tool_calls)


TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": ToolParser("hermes", _HermesStream),
    "llama3_json": ToolParser("llama3_json", _Llama3JsonStream),
    "mistral": ToolParser("mistral", _MistralStream, make_id=mistral_call_id, special_marker=True),
    "openai": ToolParser("openai", _HarmonyStream, special_marker=True),
}


# The format forced calls (tool_choice "required" or a named function) are written in
# when the server names no --tool-call-parser.
DEFAULT_FORCED_FORMAT = "hermes"


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name`` (vLLM's ``--tool-call-parser`` values)."""
    parser = TOOL_PARSERS.get(name)
    if parser is None:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"tool_call_parser must be one of {known}, got {name!r}")
    return parser
