"""--reasoning-parser openai_gptoss: GPT-OSS's harmony output split into its analysis channel
(``reasoning``) and its final channel (``content``). The split against hand-worked cases,
streamed in every pair of cut points; a chat response built from a tiny tokenizer that has
harmony's special tokens (the text decoded with them, reasoning_tokens counted over the
analysis message's tokens, whole and streamed alike); a live server whose sampled outputs
(tokens restricted to the markers and a few words) split as the whole text does; a
constrained answer started at the final channel; and the refusals (a model without the
markers, a thinking budget)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import httpx
import pytest
from helpers_models import with_renamed_tokens, write_tiny_hf_model
from server_harness import ENGINE_KWARGS, start_live_server

from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.engine.output import CompletionOutput
from kvloom.server.background import start_background_server
from kvloom.server.reasoning_parsers import REASONING_PARSERS, reasoning_stream, split_reasoning
from kvloom.server.settings import ServerSettings

HARMONY = REASONING_PARSERS["openai_gptoss"]
ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>"
CALL = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"

# output -> (reasoning, content), worked by hand.
CASES = {
    f"{ANALYSIS}User greets.<|end|>{FINAL}Hello!": ("User greets.", "Hello!"),
    f"{ANALYSIS}a<|end|>{ANALYSIS}b<|end|>{FINAL}c": ("ab", "c"),  # two analysis messages
    f"{ANALYSIS}still thinking": ("still thinking", None),  # cut inside the analysis
    f"{ANALYSIS}a<|end|><|start|>assist": ("a", None),  # cut inside the next header: dropped
    "<|channel|>final<|message|>Hi<|return|>": (None, "Hi"),
    f"{ANALYSIS}a<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>{FINAL}b":
        ("a", "Checking.b"),  # a preamble to the user is content
    f"{ANALYSIS}a<|end|>{CALL}{{\"city\": \"Paris\"}}": ("a", f'{CALL}{{"city": "Paris"}}'),  # a tool call, whole
    "Plain answer.": (None, "Plain answer."),  # no harmony at all
    "final<|channel|>analysis<|message|>x": (None, "final<|channel|>analysis<|message|>x"),  # text before a header
    f"{ANALYSIS}x <|en": ("x <|en", None),  # an unfinished end marker is text
    "<|chan": (None, None),  # a header cut short
}


@pytest.mark.parametrize(("text", "expected"), list(CASES.items()), ids=list(CASES))
def test_the_split_is_the_hand_worked_one_whole_and_in_any_three_pieces(
        text: str, expected: tuple[str | None, str | None]) -> None:
    assert split_reasoning(HARMONY, text, True) == expected
    whole = tuple(part or "" for part in expected)
    for first, second in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        stream = reasoning_stream(HARMONY, True)
        pieces = [stream.feed(text[:first]), stream.feed(text[first:second]), stream.feed(text[second:]),
                  stream.finish()]
        assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == whole, (first, second)


MARKERS = {"<|extra_0|>": "<|start|>", "<|extra_1|>": "<|channel|>", "<|extra_2|>": "<|message|>",
           "<|extra_3|>": "<|end|>", "<|extra_4|>": "analysis", "<|extra_5|>": "final", "<|extra_6|>": "assistant",
           "<|extra_7|>": "<|return|>", "<|extra_8|>": "<|call|>"}
WORDS = ("analysis", "final", "assistant")  # ordinary tokens: the text keeps them with the special tokens dropped


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, nine of its padding tokens renamed: harmony's six markers (special)
    and three words."""
    path = write_tiny_hf_model(tmp_path_factory.mktemp("harmony"), arch="llama")
    return with_renamed_tokens(path, MARKERS, [name for name in MARKERS.values() if name not in WORDS])


def test_a_chat_response_splits_the_tokens_and_counts_the_analysis_ones(harmony_model: Path) -> None:
    from kvloom.server.serving_chat import Reasoning, _Response
    from kvloom.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_file(harmony_model / "tokenizer.json")

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    analysis, final = ids("<|channel|>analysis<|message|> quick fox"), ids("<|end|><|start|>assistant<|channel|>final")
    answer = ids("<|message|> the fox")
    output = analysis + final + answer
    text = tokenizer.decode(output, skip_special_tokens=False)
    assert text == ("<|channel|>analysis<|message|> quick fox<|end|><|start|>assistant<|channel|>final<|message|>"
                    " the fox")
    reasoning = Reasoning(HARMONY, True, True, None, None, None,
                          lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=False))
    # The analysis message's tokens from its <|message|> to its <|end|>: " quick fox" and the two markers.
    assert reasoning.tokens(output) == len(ids("<|message|> quick fox<|end|>"))
    response = _Response("r", "m", 0, None, reasoning=reasoning)
    choice = response.choice(0, CompletionOutput(0, text, output, "stop"))
    assert (choice["message"]["reasoning"], choice["message"]["content"]) == (" quick fox", " the fox")
    streamed = {"reasoning": "", "content": ""}
    for position, token_id in enumerate(output):  # a token at a time, as the server streams them
        last = position == len(output) - 1
        delta = response.delta_choice(0, tokenizer.decode([token_id], skip_special_tokens=False), None,
                                      "stop" if last else None)
        for key in streamed:
            streamed[key] += (delta or {}).get("delta", {}).get(key) or ""
    assert streamed == {"reasoning": " quick fox", "content": " the fox"}


def test_a_live_server_splits_sampled_outputs_as_their_text(harmony_model: Path) -> None:
    """Outputs sampled from the markers and a few words (most are no valid harmony, some
    are): each reply's reasoning and content, whole and streamed, are the split of its
    tokens decoded with the special tokens kept; its reasoning_tokens are the count of the
    analysis message's tokens; the refusals are 400s naming their field."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(harmony_model / "tokenizer.json"))
    allowed = [tokenizer.token_to_id(t) for t in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>",
                                                  "analysis", "final", "Ġquick", "Ġfox")]
    assert None not in allowed
    live = start_live_server(harmony_model, ServerSettings(served_model_name="oss", reasoning_parser="openai_gptoss"))
    body = {"model": "oss", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 14, "temperature": 1.0,
            "return_token_ids": True, "allowed_token_ids": allowed}
    try:
        for seed in range(12):
            reply = httpx.post(f"{live.base_url}/v1/chat/completions", json={**body, "seed": seed}, timeout=60)
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            expected = split_reasoning(HARMONY, tokenizer.decode(choice["token_ids"], skip_special_tokens=False), True)
            assert (choice["message"]["reasoning"], choice["message"]["content"]) == expected
            parts = {"reasoning": "", "content": ""}
            with httpx.stream("POST", f"{live.base_url}/v1/chat/completions", timeout=60,
                              json={**body, "seed": seed, "stream": True}) as events:
                for line in events.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        for streamed in json.loads(line[len("data: "):])["choices"]:
                            for key in parts:
                                parts[key] += streamed["delta"].get(key) or ""
            assert (parts["reasoning"] or None, parts["content"] or None) == expected, seed
        plain = {key: value for key, value in body.items() if key != "allowed_token_ids"}
        refused = httpx.post(f"{live.base_url}/v1/chat/completions", json={**plain, "thinking_token_budget": 4},
                             timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "thinking_token_budget"
        constrained = httpx.post(f"{live.base_url}/v1/chat/completions", timeout=60,
                                 json={**plain, "response_format": {"type": "json_object"}})
        assert constrained.status_code == 200, constrained.text  # free until a final channel opens
        live.assert_idle_and_clean()
    finally:
        live.stop()


def test_a_constrained_answer_starts_in_the_final_channel(harmony_model: Path) -> None:
    """response_format under harmony: the grammar starts after the output first ends with
    <|channel|>final<|message|> (StructuredOutput.after_token_id as that sequence), so the
    analysis channel and the headers are free."""
    import dataclasses

    from kvloom.sampling_params import SamplingParams
    from kvloom.server.serving_chat import Reasoning, after_reasoning
    from kvloom.structured import StructuredOutput
    from kvloom.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_file(harmony_model / "tokenizer.json")
    opening = tuple(tokenizer.token_to_id(token) for token in ("<|channel|>", "final", "<|message|>"))
    reasoning = Reasoning(HARMONY, True, True, None, None, None, None, opening)
    params = after_reasoning(SamplingParams(structured=StructuredOutput(json_object=True)), reasoning)
    assert params.structured is not None and params.structured.after_token_id == opening
    assert params.skip_special_tokens is False  # the headers stay in the text for the split
    unconstrained = after_reasoning(SamplingParams(), reasoning)
    assert unconstrained.structured is None and dataclasses.replace(unconstrained, skip_special_tokens=True) == \
        SamplingParams()


def test_a_model_without_harmonys_tokens_is_refused_when_it_loads(tmp_path: Path) -> None:
    plain = write_tiny_hf_model(tmp_path / "plain", arch="llama")
    config = EngineConfig.from_kwargs(str(plain), **ENGINE_KWARGS)
    with pytest.raises(RuntimeError, match=r"reasoning-parser openai_gptoss needs '<\|start\|>' as a token"):
        start_background_server(lambda: LLMEngine(config), ServerSettings(reasoning_parser="openai_gptoss"))


# --tool-call-parser openai: the content openai_gptoss leaves -> (content, [(name, arguments)]), by hand.
CALL_CASES = {
    f'{CALL}{{"city": "Paris"}}': (None, [("get_weather", '{"city": "Paris"}')]),
    'Sure.<|channel|>commentary to=functions.f<|message|>{"a":1}<|call|>': ("Sure.", [("f", '{"a": 1}')]),
    # the recipient beside the role, two calls, whitespace between and after them dropped
    '<|start|>assistant to=functions.g<|channel|>commentary json<|message|> {"x": [1,2]} '
    '<|start|>assistant<|channel|>commentary to=functions.h<|message|>{}<|call|>  ':
        (None, [("g", '{"x": [1, 2]}'), ("h", "{}")]),
    '<|channel|>commentary to=functions.f<|message|>{"a": "}"} then text': (" then text", [("f", '{"a": "}"}')]),
    "<|channel|>commentary to=functions.f<|message|>not json": (
        "<|channel|>commentary to=functions.f<|message|>not json", []),  # malformed: content, verbatim
    '<|channel|>commentary<|message|>{"a": 1}': ('<|channel|>commentary<|message|>{"a": 1}', []),  # no recipient
    '<|channel|>commentary to=functions.f<|message|>{"a": 1': (
        '<|channel|>commentary to=functions.f<|message|>{"a": 1', []),  # cut inside the arguments
    "No call.": ("No call.", []),
}


@pytest.mark.parametrize(("text", "expected"), list(CALL_CASES.items()), ids=list(CALL_CASES))
def test_the_openai_tool_parser_reads_harmony_calls_whole_and_in_any_three_pieces(
        text: str, expected: tuple[str | None, list[tuple[str, str]]]) -> None:
    from kvloom.server.tool_call_stream import calls_from_deltas
    from kvloom.server.tool_parsers import get_tool_parser

    parser = get_tool_parser("openai")
    content, calls = parser.parse(text, make_id=lambda: "id")
    assert (content, [(call.name, call.arguments) for call in calls]) == expected
    for first, second in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        stream = parser.stream(lambda: "id")
        deltas = [stream.feed(text[:first]), stream.feed(text[first:second]), stream.feed(text[second:]),
                  stream.finish()]
        assert ("".join(d.content for d in deltas) or None,
                calls_from_deltas(c for d in deltas for c in d.tool_calls)) == (content, calls), (first, second)


def test_reasoning_then_a_call_make_one_message_and_the_parser_needs_the_reasoning_parser() -> None:
    from kvloom.server.serving_chat import Reasoning, _Response
    from kvloom.server.tool_parsers import get_tool_parser

    text = f'{ANALYSIS}Need the weather.<|end|>{CALL}{{"city": "Paris"}}'
    reasoning = Reasoning(HARMONY, True, True, None, None, None, None)
    response = _Response("r", "m", 0, None, tool_parser=get_tool_parser("openai"), reasoning=reasoning)
    choice = response.choice(0, CompletionOutput(0, text, [], "stop"))
    message = choice["message"]
    assert (message["reasoning"], message["content"], choice["finish_reason"]) == ("Need the weather.", None,
                                                                                   "tool_calls")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}')]
    with pytest.raises(ValueError, match="tool_call_parser 'openai' reads GPT-OSS's harmony messages: it needs "
                                         "reasoning_parser 'openai_gptoss'"):
        ServerSettings(tool_call_parser="openai", enable_auto_tool_choice=True)
