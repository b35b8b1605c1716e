"""``use_beam_search`` over HTTP (server/beam_search.py) on the tiny model (fp32): the n
choices are the naive reference search's beams over transformers' own model, best first,
on both endpoints; the fields beam search would not honour are 400s naming them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from helpers_beam import naive_beam_search
from server_harness import SERVED_NAME, LiveServer

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def eos(tiny_llama: Path) -> set[int]:
    from kvloom.config import EngineConfig
    from kvloom.engine.engine import LLMEngine
    return set(LLMEngine(EngineConfig.from_kwargs(str(tiny_llama), num_blocks=8)).eos_token_ids)


def post(http: httpx.Client, path: str, status: int = 200, **body: Any) -> dict[str, Any]:
    response = http.post(path, json={"model": SERVED_NAME, **body})
    assert response.status_code == status, response.text
    return response.json()


def texts_of(http: httpx.Client, beams: list[tuple[list[int], float, str]]) -> list[tuple[str, str]]:
    """Each reference beam's text (its tokens but a final EOS) and finish reason."""
    return [(http.post("/detokenize", json={"tokens": tokens[:-1] if reason == "stop" else tokens}).json()["prompt"],
             reason) for tokens, _, reason in beams]


@pytest.mark.parametrize("length_penalty", [1.0, 0.3])
def test_completion_choices_are_the_reference_beams(http: httpx.Client, live_server: LiveServer,
                                                    reference: torch.nn.Module, eos: set[int],
                                                    length_penalty: float) -> None:
    prompts = [[5, 17, 42, 9], [100, 3, 77]]
    # Special tokens kept in the text, as /detokenize keeps them (random weights pick them).
    out = post(http, COMPLETIONS, prompt=prompts, n=3, max_tokens=6, use_beam_search=True,
               length_penalty=length_penalty, temperature=0, skip_special_tokens=False, return_token_ids=True)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(6))
    for index, prompt in enumerate(prompts):
        beams = naive_beam_search(reference, prompt, 3, 6, eos, length_penalty)
        got = [(c["text"], c["finish_reason"]) for c in choices[3 * index:3 * index + 3]]
        assert got == texts_of(http, beams)
        # return_token_ids: each beam's tokens (a final EOS included) and its prompt's.
        assert [(c["prompt_token_ids"], c["token_ids"]) for c in choices[3 * index:3 * index + 3]] == \
            [(prompt, tokens) for tokens, _, _ in beams]
    assert out["usage"]["prompt_tokens"] == 7 and out["usage"]["completion_tokens"] > 0
    live_server.assert_idle_and_clean()


def test_chat_choices_are_the_reference_beams(http: httpx.Client, live_server: LiveServer,
                                              reference: torch.nn.Module, eos: set[int]) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    prompt = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    out = post(http, CHAT, messages=messages, n=2, max_completion_tokens=5, use_beam_search=True,
               skip_special_tokens=False)
    got = [(c["message"]["content"], c["finish_reason"]) for c in sorted(out["choices"], key=lambda c: c["index"])]
    assert got == texts_of(http, naive_beam_search(reference, prompt, 2, 5, eos, 1.0))
    assert all(c["message"]["role"] == "assistant" for c in out["choices"])
    live_server.assert_idle_and_clean()


def streamed(http: httpx.Client, path: str, **body: Any) -> tuple[dict[int, str], dict[int, str], dict[str, Any]]:
    """A streamed response's text and finish reason per choice, and its usage chunk's usage."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage: dict[str, Any] = {}
    with http.stream("POST", path, json={"model": SERVED_NAME, **body, "stream": True,
                                         "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    delta = choice.get("text") if path == COMPLETIONS else choice["delta"].get("content")
                    texts[choice["index"]] = texts.get(choice["index"], "") + (delta or "")
                    if choice["finish_reason"]:
                        reasons[choice["index"]] = choice["finish_reason"]
    return texts, reasons, usage


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_streamed_search_sends_the_reference_beams(http: httpx.Client, live_server: LiveServer,
                                                     reference: torch.nn.Module, eos: set[int], path: str) -> None:
    """vLLM's: with stream, each beam's whole text in one chunk once the search has ended."""
    if path == COMPLETIONS:
        body: dict[str, Any] = {"prompt": [5, 17, 42, 9]}
        prompt = body["prompt"]
    else:
        body = {"messages": [{"role": "user", "content": "hello there"}]}
        prompt = http.post("/tokenize", json=body).json()["tokens"]
    texts, reasons, usage = streamed(http, path, **body, n=3, max_tokens=6, use_beam_search=True,
                                     skip_special_tokens=False)
    expected = texts_of(http, naive_beam_search(reference, prompt, 3, 6, eos, 1.0))
    assert [(texts[i], reasons[i]) for i in range(3)] == expected
    full = post(http, path, **body, n=3, max_tokens=6, use_beam_search=True, skip_special_tokens=False)
    assert usage == full["usage"]
    live_server.assert_idle_and_clean()


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {"temperature": 0.7}, "temperature"),
    (COMPLETIONS, {"logprobs": 2}, "logprobs"),
    (COMPLETIONS, {"stop": ["x"]}, "stop"),
    (COMPLETIONS, {"n": 65}, "n"),
    (COMPLETIONS, {"max_tokens": 300}, "max_tokens"),  # the context is 256
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
     "tools"),
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"length_penalty": 50.0}, "length_penalty"),  # a score past a float's range
])
def test_what_beam_search_would_not_honour_is_refused(http: httpx.Client, live_server: LiveServer, path: str,
                                                      body: dict[str, Any], param: str) -> None:
    prompt = {"prompt": "hello"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "hi"}]}
    error = post(http, path, 400, **prompt, **{"n": 2, "max_tokens": 4, **body}, use_beam_search=True)["error"]
    assert error["param"] == param, error
    live_server.assert_idle_and_clean()


def test_length_penalty_without_beam_search_is_refused(http: httpx.Client) -> None:
    error = post(http, COMPLETIONS, 400, prompt="hello", max_tokens=2, length_penalty=2.0)["error"]
    assert error["param"] == "length_penalty" and "use_beam_search" in error["message"]
