"""--reasoning-parser: a thinking model's output split into ``reasoning`` and ``content``
in chat completions. The split against hand-worked cases and DeepSeek R1's rule as vLLM
states it (a leading ``<think>`` dropped, the reasoning up to the first ``</think>``, all
reasoning without one), streamed in every pair of cut points; a live server on a tiny
model whose vocabulary has the markers, its sampled outputs (tokens restricted to the
markers and two words) held to that rule applied to the tokens decoded by Hugging Face
``tokenizers``, whole and streamed; and the refusals."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers_models import with_renamed_tokens, write_tiny_hf_model
from server_harness import ENGINE_KWARGS, start_live_server

from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.server.background import start_background_server
from kvloom.server.protocol import ChatMessage
from kvloom.server.reasoning_parsers import REASONING_PARSERS, ReasoningStream, split_reasoning
from kvloom.server.settings import ServerSettings

R1 = REASONING_PARSERS["deepseek_r1"]

# (output, thinking) -> (reasoning, content), worked by hand.
CASES = {
    ("I think so.</think>Yes.", True): ("I think so.", "Yes."),
    ("<think>I think so.</think>Yes.", True): ("I think so.", "Yes."),
    ("still thinking", True): ("still thinking", None),  # cut before the end marker
    ("</think>Yes.", True): (None, "Yes."),
    ("a</think>b</think>c", True): ("a", "b</think>c"),  # only the first marker ends it
    ("x<think>y</think>z", True): ("x<think>y", "z"),  # a start marker later on is text
    ("<thi", True): ("<thi", None),  # the output ends inside what could have been a marker
    ("abc</thin", True): ("abc</thin", None),
    ("<think>", True): (None, None),
    ("<think>a</think>b", False): (None, "<think>a</think>b"),  # not thinking: all content
}


def r1_rule(text: str) -> tuple[str | None, str | None]:
    """vLLM's DeepSeek R1 rule, written out: drop a leading <think>, split at the first </think>."""
    text = text.removeprefix("<think>")
    reasoning, found, content = text.partition("</think>")
    return reasoning or None, (content or None) if found else None


@pytest.mark.parametrize(("case", "expected"), list(CASES.items()), ids=[repr(text) for text, _ in CASES])
def test_the_split_is_the_hand_worked_one(case: tuple[str, bool], expected: tuple[str | None, str | None]) -> None:
    text, thinking = case
    assert split_reasoning(R1, text, thinking) == expected
    if thinking:
        assert r1_rule(text) == expected


@pytest.mark.parametrize(("text", "thinking"), list(CASES))
def test_streamed_in_any_three_pieces_it_is_the_whole_split(text: str, thinking: bool) -> None:
    whole = tuple(part or "" for part in split_reasoning(R1, text, thinking))
    for first, second in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        stream = ReasoningStream(R1, thinking)
        pieces = [stream.feed(text[:first]), stream.feed(text[first:second]), stream.feed(text[second:]),
                  stream.finish()]
        assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == whole, (first, second)


GRANITE = REASONING_PARSERS["granite"]
MISTRAL = REASONING_PARSERS["mistral"]

# Formats whose model opens its reasoning itself: (format, output) -> (reasoning, content), by hand.
OPENED_BY_OUTPUT_CASES = {
    ("granite", "Here is my thought process: a b Here is my response: c"): (" a b ", " c"),
    ("granite", "Here's my thought process:x Here's my response:y"): ("x ", "y"),
    ("granite", "Here is my thought process:x Here's my response:y"): ("x ", "y"),  # either spelling of each
    ("granite", "Here is my thought process: a Here is my response: b Here is my response: c"):
        (" a ", " b Here is my response: c"),  # the first response marker ends it
    ("granite", "Here is my thought process: still"): (" still", None),  # cut before the response
    ("granite", "Here is my thought process:"): (None, None),
    ("granite", "Plain answer."): (None, "Plain answer."),  # never opened: all content
    ("granite", "Sure. Here is my thought process: x"): (None, "Sure. Here is my thought process: x"),
    ("granite", "Here is my"): (None, "Here is my"),  # the output ends before its marker does
    ("mistral", "[THINK]a[/THINK]b"): ("a", "b"),
    ("mistral", "[THINK]a[/THINK]b[/THINK]c"): ("a", "b[/THINK]c"),
    ("mistral", "[THINK]a"): ("a", None),
    ("mistral", "b"): (None, "b"),
    ("mistral", "x[THINK]a[/THINK]b"): (None, "x[THINK]a[/THINK]b"),
    ("mistral", "[THI"): (None, "[THI"),
}


def opened_by_output_rule(name: str, text: str) -> tuple[str | None, str | None]:
    """vLLM's Granite and Mistral rules for an output that begins with its opening
    marker, written out: the reasoning up to the first closing marker; an output that
    does not begin with one is all content."""
    import re
    opening, closing = {"granite": (r"(?:Here's|Here is) my thought process:", r"(?:Here's|Here is) my response:"),
                        "mistral": (r"\[THINK\]", r"\[/THINK\]")}[name]
    match = re.match(rf"{opening}(.*?)(?:{closing}(.*))?\Z", text, re.DOTALL)
    if match is None:
        return None, text or None
    return match.group(1) or None, match.group(2) or None


@pytest.mark.parametrize(("case", "expected"), list(OPENED_BY_OUTPUT_CASES.items()),
                         ids=[f"{name}:{text!r}" for name, text in OPENED_BY_OUTPUT_CASES])
def test_a_format_the_model_opens_splits_as_the_hand_worked_case(case: tuple[str, str],
                                                                 expected: tuple[str | None, str | None]) -> None:
    name, text = case
    assert split_reasoning(REASONING_PARSERS[name], text, True) == expected
    assert opened_by_output_rule(name, text) == expected
    whole = tuple(part or "" for part in expected)
    for first, second in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        stream = ReasoningStream(REASONING_PARSERS[name], True)
        pieces = [stream.feed(text[:first]), stream.feed(text[first:second]), stream.feed(text[second:]),
                  stream.finish()]
        assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == whole, (first, second)


@pytest.mark.parametrize(("name", "kwargs", "thinks"), [
    ("deepseek_r1", {}, True), ("deepseek_r1", {"enable_thinking": False}, True),  # R1 always thinks
    ("minimax_m2", {}, True),
    ("qwen3", {}, True), ("qwen3", {"enable_thinking": True}, True), ("qwen3", {"enable_thinking": False}, False),
    ("deepseek_v3", {}, False), ("deepseek_v3", {"thinking": True}, True),
    ("deepseek_v3", {"enable_thinking": True}, True), ("deepseek_v3", {"thinking": False}, False),
    ("deepseek_v3", {"thinking": False, "enable_thinking": True}, True),
])
def test_which_requests_think_is_vllms_rule(name: str, kwargs: dict[str, Any], thinks: bool) -> None:
    """vLLM's parsers, written out: R1's and MiniMax M2's always open in the reasoning,
    Qwen3's unless enable_thinking is false, DeepSeek V3.1's only where thinking or
    enable_thinking is true."""
    assert REASONING_PARSERS[name].thinks(kwargs) is thinks


def test_deepseek_v3_splits_only_a_request_that_asks_to_think(thinking_model: Path) -> None:
    live = start_live_server(thinking_model, ServerSettings(served_model_name="v3", reasoning_parser="deepseek_v3"))
    try:
        body = {"model": "v3", "messages": [{"role": "user", "content": "Think about foxes."}], "max_tokens": 10,
                "temperature": 0.0, "return_token_ids": True, "skip_special_tokens": False}
        plain = httpx.post(f"{live.base_url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        text = httpx.post(f"{live.base_url}/detokenize", json={"tokens": plain["token_ids"]}, timeout=60).json()
        assert plain["message"]["reasoning"] is None and plain["message"]["content"] == text["prompt"]
        asked = httpx.post(f"{live.base_url}/v1/chat/completions", timeout=60,
                           json={**body, "chat_template_kwargs": {"thinking": True}}).json()["choices"][0]
        assert asked["token_ids"] == plain["token_ids"]  # this template ignores the switch: the same output
        assert (asked["message"]["reasoning"], asked["message"]["content"]) == r1_rule(text["prompt"])
    finally:
        live.stop()


def test_a_prior_turns_reasoning_reaches_the_template_as_reasoning_content() -> None:
    for field in ("reasoning", "reasoning_content"):
        message = ChatMessage.model_validate({"role": "assistant", "content": "Yes.", field: "I think so."})
        assert message.to_template() == {"role": "assistant", "content": "Yes.", "reasoning_content": "I think so.",
                                         "thinking": "I think so."}
    with pytest.raises(ValueError, match="only allowed on assistant messages"):
        ChatMessage.model_validate({"role": "user", "content": "Hi", "reasoning": "x"})
    with pytest.raises(ValueError, match="differ"):
        ChatMessage.model_validate({"role": "assistant", "content": "Hi", "reasoning": "x", "reasoning_content": "y"})


def with_markers(path: Path, start: str, end: str, special: bool) -> Path:
    """The tiny model at ``path``, two of its padding tokens renamed ``start`` and ``end``."""
    return with_renamed_tokens(path, {"<|extra_0|>": start, "<|extra_1|>": end}, (start, end) if special else ())


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, two of its padding tokens renamed <think> and </think> (not special:
    the decoded text keeps them, as DeepSeek R1's and Qwen3's tokenizers do)."""
    return with_markers(write_tiny_hf_model(tmp_path_factory.mktemp("thinking"), arch="llama"), "<think>", "</think>",
                        special=False)


@pytest.fixture(scope="module")
def magistral_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with [THINK] and [/THINK] as special tokens, as Mistral's tokenizers have them."""
    return with_markers(write_tiny_hf_model(tmp_path_factory.mktemp("magistral"), arch="llama"), "[THINK]",
                        "[/THINK]", special=True)


def test_mistral_outputs_that_open_their_reasoning_split_at_its_special_markers(magistral_model: Path,
                                                                                thinking_model: Path) -> None:
    """--reasoning-parser mistral: sampled outputs (tokens restricted to the two special
    markers and two words) split as the rule says on their text decoded with the special
    tokens, whole and streamed; an output that does not begin with [THINK] is all
    content with no reasoning tokens. A model whose markers are not special tokens (or
    missing) is refused when it loads."""
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(magistral_model / "tokenizer.json"))
    think, end = tokenizer.token_to_id("[THINK]"), tokenizer.token_to_id("[/THINK]")
    allowed = [think, end, tokenizer.token_to_id("Ġquick"), tokenizer.token_to_id("Ġfox")]
    live = start_live_server(magistral_model, ServerSettings(served_model_name="thinker", reasoning_parser="mistral"))
    opened = closed = capped = 0
    budget = 2
    try:
        for seed in range(10):
            message, tokens = chat(live.base_url, seed, stream=False, allowed=allowed)
            # A thinking budget counts the tokens after [THINK]: where they reach it with no
            # [/THINK], that is the next token (the positions before sample as unbudgeted).
            with_budget, budgeted = chat(live.base_url, seed, stream=False, allowed=allowed,
                                         thinking_token_budget=budget)
            if tokens[0] != think or end in tokens[:budget + 2]:
                assert budgeted == tokens  # nothing to cap: the same sample
            else:
                assert budgeted[:budget + 2] == [*tokens[:budget + 1], end]
                assert with_budget["details"] == {"reasoning_tokens": budget + 1}  # [THINK] and two
                capped += 1
            expected = opened_by_output_rule("mistral", tokenizer.decode(tokens, skip_special_tokens=False))
            assert (message["reasoning"], message["content"]) == expected, tokens
            thought = 0 if tokens[0] != think else tokens.index(end) if end in tokens else len(tokens)
            assert message["details"] == {"reasoning_tokens": thought}
            streamed, streamed_tokens = chat(live.base_url, seed, stream=True, allowed=allowed)
            assert streamed_tokens == tokens
            assert (streamed["reasoning"], streamed["content"], streamed["details"]) == (*expected, message["details"])
            opened += tokens[0] == think
            closed += tokens[0] == think and end in tokens
        assert opened and closed and opened < 10 and capped  # reasoned, answered, never opened, capped
        live.assert_idle_and_clean()
    finally:
        live.stop()
    config = EngineConfig.from_kwargs(str(thinking_model), **ENGINE_KWARGS)
    with pytest.raises(RuntimeError, match=r"reasoning-parser mistral needs '\[THINK\]' as a token"):
        start_background_server(lambda: LLMEngine(config), ServerSettings(reasoning_parser="mistral"))
    from kvloom.server.reasoning_parsers import ReasoningFormat, check_vocabulary
    from kvloom.tokenizer import Tokenizer as EngineTokenizer
    plain = EngineTokenizer.from_file(thinking_model / "tokenizer.json")
    with pytest.raises(ValueError, match=r"'<think>' \(token \d+\) is not a special token"):
        check_vocabulary(ReasoningFormat("special_think", markers="special"), plain)


def test_granite_outputs_split_at_its_phrases_and_count_the_tokens_before_the_answer(thinking_model: Path) -> None:
    """--reasoning-parser granite: the model writes "Here is my thought process:" and
    "Here's my response:" as text. A constraint holds from the first token for a format
    the model opens itself, so a guided_regex writes both phrases: each sampled output's
    split is the rule's on its text, whole and streamed, and reasoning_tokens the most
    leading tokens whose text lies within the opening phrase and the reasoning (counted
    here one prefix at a time)."""
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(thinking_model / "tokenizer.json"))
    live = start_live_server(thinking_model, ServerSettings(served_model_name="thinker", reasoning_parser="granite"))
    regex = "(Here is|Here's) my thought process:( quick| fox){0,3}(Here is|Here's) my response:( fox| quick){1,2}"
    try:
        for seed in range(3):
            body = {"model": "thinker", "messages": [{"role": "user", "content": "Think."}], "max_tokens": 120,
                    "temperature": 1.0, "seed": seed, "guided_regex": regex, "return_token_ids": True}
            reply = httpx.post(f"{live.base_url}/v1/chat/completions", json=body, timeout=60).json()
            tokens, message = reply["choices"][0]["token_ids"], reply["choices"][0]["message"]
            text = tokenizer.decode(tokens)
            expected = opened_by_output_rule("granite", text)
            assert expected[1] is not None and (message["reasoning"], message["content"]) == expected
            within = len(text) - len(expected[1]) - len("Here is my response:" if "Here is my response:" in text
                                                          else "Here's my response:")
            thought = max(k for k in range(len(tokens) + 1) if len(tokenizer.decode(tokens[:k])) <= within)
            assert reply["usage"]["completion_tokens_details"] == {"reasoning_tokens": thought}
            parts = {"reasoning": "", "content": ""}
            with httpx.stream("POST", f"{live.base_url}/v1/chat/completions", timeout=60,
                              json={**body, "stream": True}) as events:
                for line in events.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        for choice in json.loads(line[len("data: "):])["choices"]:
                            for key in parts:
                                parts[key] += choice["delta"].get(key) or ""
            assert (parts["reasoning"] or None, parts["content"] or None) == expected
        budget = httpx.post(f"{live.base_url}/v1/chat/completions", timeout=60, json={
            "model": "thinker", "messages": [{"role": "user", "content": "Hi"}], "thinking_token_budget": 4})
        assert budget.status_code == 400 and budget.json()["error"]["param"] == "thinking_token_budget"
        live.assert_idle_and_clean()
    finally:
        live.stop()


@pytest.fixture(scope="module")
def server(thinking_model: Path) -> Iterator[Any]:
    live = start_live_server(thinking_model, ServerSettings(served_model_name="thinker", reasoning_parser="qwen3"))
    yield live
    live.stop()


def chat(base_url: str, seed: int, stream: bool, **extra: Any) -> tuple[dict[str, Any], list[int]]:
    """(the message, whole or reassembled from its deltas, with the usage's
    completion_tokens_details as "details"; and the output's token ids)."""
    body = {"model": "thinker", "messages": [{"role": "user", "content": "Think, then answer."}],
            "max_tokens": 12, "temperature": 1.0, "seed": seed, "stream": stream, "return_token_ids": True,
            "allowed_token_ids": extra.pop("allowed"), **extra}
    if not stream:
        reply = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        return {**choice["message"], "details": reply.json()["usage"].get("completion_tokens_details")}, \
            choice["token_ids"]
    parts: dict[str, str] = {"reasoning": "", "content": ""}
    tokens: list[int] = []
    details = None
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", timeout=60,
                      json={**body, "stream_options": {"include_usage": True}}) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if not chunk["choices"]:  # the usage chunk
                details = chunk["usage"].get("completion_tokens_details")
                continue
            delta = chunk["choices"][0]["delta"]
            for key in parts:
                parts[key] += delta.get(key) or ""
            tokens += chunk["choices"][0].get("token_ids") or []
    return {**{key: value or None for key, value in parts.items()}, "details": details}, tokens


def test_sampled_outputs_split_as_the_rule_says_whole_and_streamed(server: Any, thinking_model: Path) -> None:
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(thinking_model / "tokenizer.json"))
    think, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    allowed = [think, end, tokenizer.token_to_id("Ġquick"), tokenizer.token_to_id("Ġfox")]
    assert None not in allowed
    seen_content = False
    for seed in range(8):
        message, tokens = chat(server.base_url, seed, stream=False, allowed=allowed)
        expected = r1_rule(tokenizer.decode(tokens, skip_special_tokens=True))
        assert (message["reasoning"], message["content"]) == expected, tokens
        thought = tokens.index(end) if end in tokens else len(tokens)  # the tokens before </think>
        assert message["details"] == {"reasoning_tokens": thought}
        streamed, streamed_tokens = chat(server.base_url, seed, stream=True, allowed=allowed)
        assert streamed_tokens == tokens  # the same seed: the same output
        assert (streamed["reasoning"], streamed["content"], streamed["details"]) == (*expected, message["details"])
        seen_content |= expected[1] is not None
        # Without the reasoning, the same content; told not to think (Qwen3's switch), all content.
        message, _ = chat(server.base_url, seed, stream=False, allowed=allowed, include_reasoning=False)
        assert (message["reasoning"], message["content"]) == (None, expected[1])
        message, tokens = chat(server.base_url, seed, stream=False, allowed=allowed,
                               chat_template_kwargs={"enable_thinking": False})
        assert (message.get("reasoning"), message["content"]) == (None, tokenizer.decode(tokens) or None)
        assert message["details"] == {"reasoning_tokens": 0}
    assert seen_content  # some outputs ended their reasoning and answered


def test_a_model_without_the_markers_is_refused_when_it_loads(tiny_llama: Path) -> None:
    config = EngineConfig.from_kwargs(str(tiny_llama), **ENGINE_KWARGS)
    with pytest.raises(RuntimeError, match="reasoning-parser deepseek_r1 needs '<think>' as a token"):
        start_background_server(lambda: LLMEngine(config), ServerSettings(reasoning_parser="deepseek_r1"))


def test_an_unknown_parser_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ServerSettings(reasoning_parser="nope")


def test_the_responses_api_writes_the_reasoning_as_its_first_item() -> None:
    """A streamed output with the end marker split across pieces: a reasoning item of
    its reasoning, then a message of the rest, as events and as the Response's items;
    reasoning_tokens counts the tokens before the end marker's (token 7 here)."""
    from kvloom.server.protocol import ResponsesRequest
    from kvloom.server.serving_chat import Reasoning
    from kvloom.server.serving_responses import _ItemWriter, _Shape
    from kvloom.server.tool_calling import ToolUse

    body = ResponsesRequest(model="thinker", input="Think.")
    shape = _Shape(body, "resp_1", "thinker", ToolUse(None), 3, Reasoning(R1, True, True, end_token_id=7))
    writer = _ItemWriter(shape)
    events = (writer.feed("<think>I think", False) + writer.feed(" so.</thi", False) + writer.feed("nk>Yes.", True)
              + writer.close("stop"))
    parsed = [json.loads(event.split("data: ", 1)[1]) for event in events]
    assert [event["type"] for event in parsed] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert "".join(e["delta"] for e in parsed if e["type"] == "response.reasoning_text.delta") == "I think so."
    assert [e["output_index"] for e in parsed] == [0] * 7 + [1] * 6
    reasoning, message = writer.items
    assert (reasoning["type"], reasoning["content"], reasoning["status"]) == (
        "reasoning", [{"type": "reasoning_text", "text": "I think so."}], "completed")
    assert (message["type"], message["content"][0]["text"]) == ("message", "Yes.")
    assert shape.reasoning_tokens([4, 5, 6, 7, 8]) == 3 and shape.reasoning_tokens([4, 5]) == 2


def test_reasoning_items_sent_back_join_the_assistant_turn_they_led_to() -> None:
    from kvloom.server.protocol import ResponsesRequest
    from kvloom.server.serving_responses import _messages

    def think(text: str) -> dict[str, Any]:
        return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}

    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    body = ResponsesRequest(input=[
        {"role": "user", "content": "Hi"}, think("a"), {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Call f"}, think("b"), call,
        {"type": "function_call_output", "call_id": "c1", "output": "1"}, think("c")])
    messages, origins = _messages(body)
    assert messages == [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "reasoning": "a"},
        {"role": "user", "content": "Call f"},
        {"role": "assistant", "content": None, "reasoning": "b",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "assistant", "content": "", "reasoning": "c"}]  # it led to nothing: a turn of its own
    assert origins == ["input[0]", "input[2]", "input[3]", "input[5]", "input[6]", "input[7]"]


def test_the_responses_api_and_chat_split_the_same_output_alike(server: Any) -> None:
    ask = "Think about foxes."
    chat_reply = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "model": "thinker", "messages": [{"role": "user", "content": ask}], "max_tokens": 10, "temperature": 0.0})
    message = chat_reply.json()["choices"][0]["message"]
    reply = httpx.post(f"{server.base_url}/v1/responses", timeout=60, json={
        "model": "thinker", "input": ask, "max_output_tokens": 10, "temperature": 0.0})
    assert reply.status_code == 200, reply.text
    items = {item["type"]: item for item in reply.json()["output"]}
    assert message["reasoning"] is not None  # the template opened the reasoning
    assert items["reasoning"]["content"] == [{"type": "reasoning_text", "text": message["reasoning"]}]
    assert (items["message"]["content"][0]["text"] if "message" in items else None) == message["content"]
    usage = reply.json()["usage"]
    assert 0 < usage["output_tokens_details"]["reasoning_tokens"] <= usage["output_tokens"] == 10


def test_the_messages_api_writes_the_reasoning_as_a_thinking_block(server: Any) -> None:
    """Anthropic's Messages API splits the same output as chat: a thinking block (the
    reasoning), then the text, whole and streamed."""
    ask = "Think about foxes."
    chat_reply = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "model": "thinker", "messages": [{"role": "user", "content": ask}], "max_tokens": 10, "temperature": 0.0})
    message = chat_reply.json()["choices"][0]["message"]
    assert message["reasoning"] is not None
    body = {"model": "thinker", "messages": [{"role": "user", "content": ask}], "max_tokens": 10, "temperature": 0}
    reply = httpx.post(f"{server.base_url}/v1/messages", timeout=60, json=body)
    assert reply.status_code == 200, reply.text
    expected = [{"type": "thinking", "thinking": message["reasoning"], "signature": ""}]
    if message["content"]:
        expected.append({"type": "text", "text": message["content"]})
    assert reply.json()["content"] == expected
    blocks: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{server.base_url}/v1/messages", timeout=60, json={**body, "stream": True}) as events:
        for line in events.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: "):])
            if event["type"] == "content_block_start":
                blocks.append(dict(event["content_block"]))
            elif event["type"] == "content_block_delta":
                delta = event["delta"]
                key = "thinking" if delta["type"] == "thinking_delta" else "text"
                blocks[event["index"]][key] += delta[key]
    assert blocks == expected


def test_a_constrained_answer_follows_free_reasoning(server: Any, thinking_model: Path) -> None:
    """guided_choice on a thinking request constrains the answer after </think> (vLLM's
    rule), not the reasoning: sampled with </think> made likely, each output's content is
    one of the choices and its reasoning what came before, some of it free text."""
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(thinking_model / "tokenizer.json"))
    end = tokenizer.token_to_id("</think>")
    answered = reasoned = 0
    for seed in range(8):
        reply = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
            "model": "thinker", "messages": [{"role": "user", "content": "Yes or no?"}], "max_tokens": 16,
            "temperature": 1.0, "seed": seed, "logit_bias": {str(end): 6.0}, "guided_choice": ["yes", "no"],
            "return_token_ids": True})
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        tokens, message = choice["token_ids"], choice["message"]
        expected = r1_rule(tokenizer.decode(tokens, skip_special_tokens=True))
        assert (message["reasoning"], message["content"]) == expected
        if end in tokens:
            assert message["content"] in ("yes", "no"), tokens
            answered += 1
        reasoned += message["reasoning"] is not None
    assert answered >= 4 and reasoned >= 1  # answers came, after reasoning the grammar did not constrain


def test_a_thinking_budget_closes_the_reasoning_where_it_runs_out(server: Any, thinking_model: Path) -> None:
    """thinking_token_budget (vLLM's): the greedy output keeps its first B tokens, takes
    </think> there (this random model never writes it itself within 12 tokens), and goes
    on as a prompt of those tokens would; the split and reasoning_tokens follow; the
    Messages API's budget_tokens is the same budget."""
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(thinking_model / "tokenizer.json"))
    end = tokenizer.token_to_id("</think>")
    body = {"model": "thinker", "messages": [{"role": "user", "content": "Think about foxes."}], "max_tokens": 12,
            "temperature": 0.0, "return_token_ids": True}
    free = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60).json()
    free_tokens, prompt = free["choices"][0]["token_ids"], free["prompt_token_ids"]
    assert end not in free_tokens
    for budget in (0, 2, 5):
        reply = httpx.post(f"{server.base_url}/v1/chat/completions", json={**body, "thinking_token_budget": budget},
                           timeout=60).json()
        tokens, message = reply["choices"][0]["token_ids"], reply["choices"][0]["message"]
        assert tokens[:budget + 1] == [*free_tokens[:budget], end]
        on = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
            "model": "thinker", "prompt": prompt + tokens[:budget + 1], "max_tokens": 12 - budget - 1,
            "temperature": 0.0, "return_token_ids": True}).json()
        assert tokens[budget + 1:] == on["choices"][0]["token_ids"]
        assert (message["reasoning"], message["content"]) == r1_rule(tokenizer.decode(tokens, skip_special_tokens=True))
        assert reply["usage"]["completion_tokens_details"] == {"reasoning_tokens": budget}
    messages = httpx.post(f"{server.base_url}/v1/messages", timeout=60, json={
        "model": "thinker", "messages": body["messages"], "max_tokens": 12, "temperature": 0,
        "thinking": {"type": "enabled", "budget_tokens": 2}}).json()
    thought = tokenizer.decode(free_tokens[:2], skip_special_tokens=True)
    assert messages["content"][0] == {"type": "thinking", "thinking": thought, "signature": ""}
    for path, extra, param in (("/v1/chat/completions", {"thinking_token_budget": -1}, "thinking_token_budget"),
                               ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": "a lot"}},
                                "thinking.budget_tokens")):
        refused = httpx.post(f"{server.base_url}{path}", timeout=60,
                             json={"model": "thinker", "messages": body["messages"], "max_tokens": 4, **extra})
        assert refused.status_code == 400 and param in refused.text
    server.assert_idle_and_clean()


def test_a_thinking_budget_without_a_reasoning_parser_is_a_400(http: httpx.Client) -> None:
    refused = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "thinking_token_budget": 4})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "thinking_token_budget"
    assert "--reasoning-parser" in refused.json()["error"]["message"]
