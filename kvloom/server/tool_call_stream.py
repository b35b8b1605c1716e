"""The pieces every tool-call parser shares: OpenAI-shaped calls and deltas, call ids,
a resumable JSON-end scanner, and ``StreamingToolParser``, the incremental machine each
format (``kvloom.server.tool_parsers``) subclasses."""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One complete call; ``arguments`` is JSON text of an object."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A streamed piece of call ``index``: the first carries id and name (arguments "");
    later ones carry only an arguments chunk to append."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class StreamDelta:
    """What one ``feed`` or ``finish`` produced: content text and call deltas, in order
    within each (content text always precedes the calls it was written before)."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def openai_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def mistral_call_id() -> str:
    # Mistral's chat templates require ids of exactly nine alphanumeric characters.
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class JsonValueEnd:
    """Finds where the JSON object or array opening at ``text[start]`` ends (brackets
    balanced outside strings), resumably: ``scan`` may be called again after the text
    grew, and continues where it stopped, so a streamed call costs linear time. Says
    nothing about validity: the slice still goes through ``json.loads``."""

    __slots__ = ("position", "depth", "in_string", "escaped")

    def __init__(self, start: int) -> None:
        self.position = start
        self.depth = 0
        self.in_string = self.escaped = False

    def scan(self, text: str) -> int | None:
        """Index just past the value, or None if it is not closed in ``text`` yet."""
        for position in range(self.position, len(text)):
            char = text[position]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.position = position + 1
                    return position + 1
        self.position = len(text)
        return None


def json_value_end(text: str, start: int) -> int | None:
    """Index just past the JSON object or array opening at ``text[start]``, or None."""
    return JsonValueEnd(start).scan(text)


def call_fields(value: object, arguments_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object, or None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    present = [key for key in arguments_keys if key in value]
    arguments = value[present[0]] if present else {}
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def loads_or_none(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def held_marker_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class StreamingToolParser:
    """Incremental parser for one output: ``feed`` text deltas, then ``finish`` once.

    Subclasses implement ``_step(final)``: consume a determinable prefix of
    ``self._buffer`` (calling ``_content`` / ``_call``) and return True, or return False
    when the buffer's start cannot be decided without more text. With ``final`` the
    step must decide. Chunking invariance follows from every decision depending only
    on the text, never on where a delta ended.
    """

    def __init__(self, make_id: Callable[[], str]) -> None:
        self._make_id = make_id
        self._buffer = ""
        self._out = StreamDelta()
        self.num_calls = 0
        self._finished = False
        self._json_end: JsonValueEnd | None = None  # the pending call's scanner

    def _scan_json(self, start: int) -> int | None:
        """End of the JSON value at ``start`` of the pending call (which does not move
        while it is pending), scanning only text not scanned before."""
        if self._json_end is None:
            self._json_end = JsonValueEnd(start)
        return self._json_end.scan(self._buffer)

    def feed(self, text: str) -> StreamDelta:
        if self._finished:
            raise RuntimeError("feed after finish")
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> StreamDelta:
        if self._finished:
            raise RuntimeError("finish called twice")
        self._finished = True
        return self._run(final=True)

    def _run(self, final: bool) -> StreamDelta:
        while self._buffer and self._step(final):
            pass
        out, self._out = self._out, StreamDelta()
        return out

    def _content(self, text: str) -> None:
        self._out.content += text

    def _call(self, name: str, arguments: str) -> None:
        call_id = self._make_id()
        index = self.num_calls
        self.num_calls += 1
        self._out.tool_calls.append(ToolCallDelta(index, "", id=call_id, name=name))
        self._out.tool_calls.append(ToolCallDelta(index, arguments))

    def _step(self, final: bool) -> bool:
        raise NotImplementedError


def calls_from_deltas(deltas: Iterable[ToolCallDelta]) -> list[ToolCall]:
    """Assemble streamed call deltas into calls (what a client does)."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.id is not None:
            calls[delta.index] = [delta.id, delta.name or "", delta.arguments]
        else:
            calls[delta.index][2] += delta.arguments
    return [ToolCall(*calls[index]) for index in sorted(calls)]
