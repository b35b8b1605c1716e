"""vLLM's server switches for what responses carry and what is logged, on the tiny model:
--enable-force-include-usage, --return-tokens-as-token-ids, --response-role,
--enable-request-id-headers, --enable-log-requests with --max-log-len. Each is held to
what the request alone would give (its own stream_options, its own
return_tokens_as_token_ids) and to the tokens the response itself returns."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import SERVED_NAME, LiveServer, start_live_server

from kvloom.server.cli import add_serve_parser, server_settings
from kvloom.server.settings import ServerSettings

HI = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def flagged(tiny_llama: Path) -> Iterator[LiveServer]:
    live = start_live_server(tiny_llama, ServerSettings(
        served_model_name=SERVED_NAME, force_include_usage=True, return_tokens_as_token_ids=True,
        response_role="narrator", enable_request_id_headers=True, log_requests=True, max_log_len=3))
    yield live
    live.stop()


def post(live: LiveServer, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{live.base_url}{path}", json={"model": SERVED_NAME, "max_tokens": 5, "temperature": 0.0,
                                                      "ignore_eos": True, **body}, timeout=60)


def events(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "Hello there"}),
                                        ("/v1/chat/completions", {"messages": HI})])
def test_a_stream_that_did_not_ask_ends_with_its_usage(flagged: LiveServer, live_server: LiveServer, path: str,
                                                       body: dict[str, Any]) -> None:
    streamed = events(post(flagged, path, stream=True, return_token_ids=True, **body))
    usage = streamed[-1]["usage"]
    assert streamed[-1]["choices"] == [] and all(chunk.get("usage") is None for chunk in streamed[:-1])
    whole = post(flagged, path, return_token_ids=True, **body).json()
    tokens = sum((len(c["choices"][0].get("token_ids") or []) for c in streamed if c["choices"]), 0)
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (whole["usage"]["prompt_tokens"], tokens) == \
        (whole["usage"]["prompt_tokens"], 5)
    # Without the switch the same request's stream has no usage chunk.
    plain = events(post(live_server, path, stream=True, **body))
    assert all(chunk.get("usage") is None for chunk in plain)


def test_logprobs_name_tokens_by_id_unasked(flagged: LiveServer) -> None:
    completion = post(flagged, "/v1/completions", prompt="Hello there", logprobs=1, return_token_ids=True).json()
    choice = completion["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    chat = post(flagged, "/v1/chat/completions", messages=HI, logprobs=True, top_logprobs=1,
                return_token_ids=True).json()["choices"][0]
    assert [item["token"] for item in chat["logprobs"]["content"]] == [f"token_id:{t}" for t in chat["token_ids"]]


def test_the_reply_takes_the_response_role_where_a_turn_opens(flagged: LiveServer) -> None:
    reply = post(flagged, "/v1/chat/completions", messages=HI).json()
    assert reply["choices"][0]["message"]["role"] == "narrator"
    first = events(post(flagged, "/v1/chat/completions", messages=HI, stream=True))[0]
    assert first["choices"][0]["delta"]["role"] == "narrator"
    # A continued message keeps its own role (vLLM's rule).
    continued = post(flagged, "/v1/chat/completions", add_generation_prompt=False, continue_final_message=True,
                     messages=[*HI, {"role": "assistant", "content": "Once upon"}]).json()
    assert continued["choices"][0]["message"]["role"] == "assistant"


def test_every_answer_carries_x_request_id(flagged: LiveServer, live_server: LiveServer) -> None:
    given = post(flagged, "/v1/completions", prompt="Hi").headers  # none sent: a fresh one
    assert re.fullmatch(r"[0-9a-f]{32}", given["x-request-id"])
    echoed = httpx.post(f"{flagged.base_url}/v1/completions", headers={"X-Request-Id": "trace-7"}, timeout=60,
                        json={"model": SERVED_NAME, "prompt": "Hi", "max_tokens": 2})
    assert echoed.status_code == 200 and echoed.headers["x-request-id"] == "trace-7"
    refused = httpx.post(f"{flagged.base_url}/v1/completions", headers={"X-Request-Id": "trace-8"}, timeout=60,
                         json={"model": "nope", "prompt": "Hi"})
    assert refused.status_code == 404 and refused.headers["x-request-id"] == "trace-8"
    assert "x-request-id" not in post(live_server, "/v1/completions", prompt="Hi").headers  # off by default


def test_each_request_is_logged_with_its_prompt_cut_to_max_log_len(flagged: LiveServer, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="kvloom.server.generation"):
        reply = post(flagged, "/v1/completions", prompt=[11, 12, 13, 14, 15], n=2, request_id="logged")
    assert reply.status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Received request cmpl-logged")]
    assert len(lines) == 2  # one per engine request (n = 2)
    for line in lines:
        assert "prompt_token_ids: [11, 12, 13, '...'] (5)" in line and "max_tokens=5" in line


def test_the_flags_set_the_settings() -> None:
    import argparse
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "m", "--enable-force-include-usage", "--return-tokens-as-token-ids",
                              "--response-role", "bot", "--enable-request-id-headers", "--enable-log-requests",
                              "--max-log-len", "7", "--enable-prompt-tokens-details",
                              "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint"])
    settings = server_settings(args)
    assert (settings.force_include_usage, settings.return_tokens_as_token_ids, settings.response_role,
            settings.enable_request_id_headers, settings.log_requests, settings.max_log_len,
            settings.enable_tokenizer_info_endpoint) == (True, True, "bot", True, True, 7, True)
    assert server_settings(parser.parse_args(["serve", "m", "--disable-log-requests"])).log_requests is False
    with pytest.raises(ValueError, match="response_role must be a non-empty string"):
        ServerSettings(response_role="")
    strict = parser.parse_args(["serve", "m", "--tool-call-parser", "hermes", "--tool-strict-level", "parameter"])
    assert server_settings(strict).tool_strict_level == "parameter"
    assert server_settings(parser.parse_args(["serve", "m"])).tool_strict_level == "auto"
    with pytest.raises(ValueError, match="tool_strict_level must be one of auto, function, parameter"):
        ServerSettings(tool_strict_level="always")
