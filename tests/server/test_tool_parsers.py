"""Tool-call parsers: hand-written outputs of each format -> expected calls and content;
malformed calls stay content; streaming over any split points concatenates to exactly
the non-streaming result (hypothesis)."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvloom.server.tool_parsers import (
    TOOL_PARSERS,
    JsonValueEnd,
    ToolCall,
    calls_from_deltas,
    get_tool_parser,
    json_value_end,
)


def counter_ids():
    numbers = itertools.count()
    return lambda: f"id{next(numbers)}"


def parse(parser_name: str, text: str):
    content, calls = get_tool_parser(parser_name).parse(text, make_id=counter_ids())
    return content, [(call.id, call.name, json.loads(call.arguments)) for call in calls]


def stream(parser_name: str, pieces: list[str]):
    """Content and calls as a client assembles them from the streamed deltas."""
    streamer = get_tool_parser(parser_name).stream(make_id=counter_ids())
    outs = [streamer.feed(piece) for piece in pieces] + [streamer.finish()]
    deltas = [delta for out in outs for delta in out.tool_calls]
    content = "".join(out.content for out in outs)
    return content or None, calls_from_deltas(deltas), deltas


CASES = [
    # hermes: one call, several, content before, whitespace between and after dropped
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("id0", "get_weather", {"city": "Paris"})]),
    ("hermes", 'Let me check.\n<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
               '<tool_call>{"name": "b", "arguments": {}}</tool_call>\n',
     "Let me check.\n", [("id0", "a", {"x": 1}), ("id1", "b", {})]),
    ("hermes", "No tools needed <tool here.", "No tools needed <tool here.", []),
    # unterminated at the end (stopped on the end marker) but complete JSON: a call
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"y": [1, 2]}}\n', None, [("id0", "a", {"y": [1, 2]})]),
    # malformed: invalid JSON, missing name, non-object arguments -> content verbatim
    ("hermes", '<tool_call>{"name": "a", "arguments": {x}}</tool_call>',
     '<tool_call>{"name": "a", "arguments": {x}}</tool_call>', []),
    ("hermes", 'A<tool_call>{"arguments": {}}</tool_call>B<tool_call>{"name": "c", "arguments": 3}</tool_call>',
     'A<tool_call>{"arguments": {}}</tool_call>B<tool_call>{"name": "c", "arguments": 3}</tool_call>', []),
    # a valid call, then a malformed one: the call, and the malformed one as content
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call> then <tool_call>{oops',
     ' then <tool_call>{oops', [("id0", "a", {})]),
    # text after a call that is not only whitespace is kept, whitespace included
    ("hermes", '<tool_call>{"name": "a"}</tool_call>\n\nDone.', "\n\nDone.", [("id0", "a", {})]),
    # llama3_json: python tag, ';' separated, "arguments" accepted too
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"q": "x"}}', None, [("id0", "f", {"q": "x"})]),
    ("llama3_json", ' {"name": "f", "parameters": {"q": 1}}; {"name": "g", "arguments": {"r": true}};\n',
     None, [("id0", "f", {"q": 1}), ("id1", "g", {"r": True})]),
    ("llama3_json", 'The answer is {"name": "f"}', 'The answer is {"name": "f"}', []),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {oops}}',
     '<|python_tag|>{"name": "f", "parameters": {oops}}', []),
    ("llama3_json", '{"name": "f", "parameters": {}} and more', " and more", [("id0", "f", {})]),
    ("llama3_json", '{"name": "f", "parameters": {}}; {"bad": 1}', '; {"bad": 1}', [("id0", "f", {})]),
    ("llama3_json", "<|python", "<|python", []),
    ("llama3_json", '{"name": "f", "parameters": {"s": "}{;"}}', None, [("id0", "f", {"s": "}{;"})]),
    # mistral: content before, array of calls, a single object, malformed array
    ("mistral", 'Sure [TOOL_CALLS][{"name": "f", "arguments": {"a": "]"}}, {"name": "g", "arguments": {}}]',
     "Sure ", [("id0", "f", {"a": "]"}), ("id1", "g", {})]),
    ("mistral", '[TOOL_CALLS] {"name": "f", "arguments": {"n": 2}}\n', None, [("id0", "f", {"n": 2})]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"n": 2}}, {"arguments": {}}]',
     '[TOOL_CALLS][{"name": "f", "arguments": {"n": 2}}, {"arguments": {}}]', []),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"n": 2',
     '[TOOL_CALLS][{"name": "f", "arguments": {"n": 2', []),
    ("mistral", "[TOOL_CALLS] no json", "[TOOL_CALLS] no json", []),
    ("mistral", "plain [TOOL_CALL", "plain [TOOL_CALL", []),
]


@pytest.mark.parametrize("parser_name, text, content, calls", CASES)
def test_parse(parser_name, text, content, calls) -> None:
    assert parse(parser_name, text) == (content, calls)


@pytest.mark.parametrize("parser_name, text, content, calls", CASES)
def test_streaming_one_character_at_a_time(parser_name, text, content, calls) -> None:
    streamed_content, streamed_calls, deltas = stream(parser_name, list(text))
    assert streamed_content == content
    assert [(call.id, call.name, json.loads(call.arguments)) for call in streamed_calls] == calls
    # the first delta of each call carries id, type, name and empty arguments
    firsts = [delta.to_openai() for delta in deltas if delta.id is not None]
    assert [first["index"] for first in firsts] == list(range(len(calls)))
    assert all(first["type"] == "function" and first["function"]["arguments"] == "" for first in firsts)
    assert all(set(delta.to_openai()) == {"index", "function"} for delta in deltas if delta.id is None)


def test_content_is_held_back_only_while_it_could_be_a_marker() -> None:
    streamer = get_tool_parser("hermes").stream(make_id=counter_ids())
    assert streamer.feed("Hi <tool").content == "Hi "  # "<tool" may start "<tool_call>"
    assert streamer.feed("box> and <").content == "<toolbox> and "
    out = streamer.feed('tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert out.content == ""
    assert [delta.to_openai() for delta in out.tool_calls] == [
        {"index": 0, "id": "id0", "type": "function", "function": {"name": "f", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"a": 1}'}},
    ]
    # whitespace after a call waits: it is dropped if nothing but whitespace follows
    assert streamer.feed("\n").content == ""
    assert streamer.finish().content == ""


def test_openai_shape_and_arguments_keep_unicode() -> None:
    content, calls = get_tool_parser("hermes").parse(
        '<tool_call>{"name": "f", "arguments": {"city": "Zürich"}}</tool_call>')
    assert content is None and len(calls) == 1
    assert calls[0].arguments == '{"city": "Zürich"}'
    shape = calls[0].to_openai()
    assert shape["type"] == "function" and shape["id"].startswith("chatcmpl-tool-")
    assert shape["function"] == {"name": "f", "arguments": '{"city": "Zürich"}'}


def test_mistral_ids_are_nine_alphanumerics() -> None:
    _, calls = get_tool_parser("mistral").parse('[TOOL_CALLS][{"name": "f", "arguments": {}}]')
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()


def test_registry_names_and_unknown_name() -> None:
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral", "openai"]
    message = "tool_call_parser must be one of hermes, llama3_json, mistral, openai, got 'pythonic'"
    with pytest.raises(ValueError, match=message):
        get_tool_parser("pythonic")


def test_feed_after_finish_is_an_error() -> None:
    streamer = get_tool_parser("hermes").stream()
    streamer.finish()
    with pytest.raises(RuntimeError, match="feed after finish"):
        streamer.feed("x")


def test_json_value_end() -> None:
    assert json_value_end('{"a": "}"} tail', 0) == 10
    assert json_value_end('[{"a": "\\"]"}]x', 0) == 14
    assert json_value_end('{"a": [1, 2', 0) is None
    # resumed after the text grew: the same answer as one scan of the whole text
    scanner = JsonValueEnd(2)
    text = 'x {"a": "\\'
    assert scanner.scan(text) is None
    text += '"}'  # the escaped quote does not close the string
    assert scanner.scan(text) is None
    text += '"} tail'
    assert scanner.scan(text) == json_value_end(text, 2) == len(text) - 5


# Random outputs built from the pieces the formats are made of (markers, their prefixes,
# valid and malformed call bodies, separators, whitespace, prose), so that splits land
# inside markers, JSON strings and held-back whitespace.
CALL = json.dumps({"name": "get_weather", "arguments": {"city": "Par]is;", "days": [1, 2]}})
CALL_L3 = json.dumps({"name": "f", "parameters": {"q": "{x}"}})
PIECES = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool", "</tool_", CALL, "\n", " ", "text", "{bad",
               '{"name": 1}', "<", "ü"],
    "llama3_json": ["<|python_tag|>", "<|python", CALL_L3, CALL, ";", "; ", " ", "\n", "{", "}", "text", '"'],
    "mistral": ["[TOOL_CALLS]", "[TOOL_", "[", "]", ",", CALL, " ", "\n", "text", "{", '"'],
}


@st.composite
def output_and_splits(draw, parser_name: str):
    text = "".join(draw(st.lists(st.sampled_from(PIECES[parser_name]), max_size=12)))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    return text, pieces


def check_split_invariance(parser_name: str, text: str, pieces: list[str]) -> None:
    whole_content, whole_calls = get_tool_parser(parser_name).parse(text, make_id=counter_ids())
    streamed_content, streamed_calls, _ = stream(parser_name, pieces)
    assert (streamed_content, streamed_calls) == (whole_content, whole_calls)
    for call in whole_calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("parser_name", sorted(PIECES))
def test_streaming_equals_parse_for_any_split(parser_name: str) -> None:
    @settings(max_examples=300, deadline=None)
    @given(output_and_splits(parser_name))
    def check(example) -> None:
        check_split_invariance(parser_name, *example)

    check()


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(PIECES)), st.text(max_size=40), st.lists(st.integers(0, 40), max_size=6))
def test_arbitrary_text_never_raises_and_is_split_invariant(parser_name: str, text: str, cuts: list[int]) -> None:
    cuts = sorted(min(cut, len(text)) for cut in cuts)
    pieces = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    check_split_invariance(parser_name, text, pieces)


def test_tool_call_equality_is_by_value() -> None:
    assert ToolCall("a", "f", "{}") == ToolCall("a", "f", "{}")
