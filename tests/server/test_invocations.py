"""SageMaker's ``POST /invocations`` and ``/ping`` (vLLM's): each body is answered as the
route its fields name answers it (chat, completions, embeddings, score, rerank; a
classifier's classify in test_classify_server.py), held to that route's own answer for
the same body; a body it cannot tell, or one its route would refuse, is a 400 saying so."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from server_harness import SERVED_NAME, LiveServer

VOLATILE = ("id", "created")  # per response, not per answer


def answer(reply: dict[str, Any]) -> dict[str, Any]:
    """A reply less what differs between two replies of one answer: its id and time, and
    the prompt tokens the prefix cache served (the second request of a pair hits it)."""
    kept = {key: value for key, value in reply.items() if key not in VOLATILE}
    if isinstance(kept.get("usage"), dict):
        kept["usage"] = {key: value for key, value in kept["usage"].items() if key != "prompt_tokens_details"}
    return kept


def same_answer(first: dict[str, Any], second: dict[str, Any]) -> bool:
    return answer(first) == answer(second)


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/chat/completions", {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}],
                              "max_tokens": 6, "temperature": 0.0}),
    ("/v1/completions", {"prompt": "The quick brown", "max_tokens": 6, "temperature": 0.0}),
    ("/v1/embeddings", {"input": ["the quick brown fox", "a dog"], "encoding_format": "float"}),
    ("/score", {"text_1": "a fox", "text_2": ["a dog", "a fox"]}),
    ("/score", {"queries": "a fox", "documents": ["a dog"]}),
    ("/rerank", {"query": "a fox", "documents": ["a dog", "a fox", "tea"], "top_n": 2}),
], ids=["chat", "completions", "embeddings", "score", "score_queries", "rerank"])
def test_a_body_is_answered_as_its_route_answers_it(http: httpx.Client, live_server: LiveServer, route: str,
                                                    body: dict[str, Any]) -> None:
    direct = http.post(route, json=body)
    invoked = http.post("/invocations", json=body)
    assert direct.status_code == invoked.status_code == 200, invoked.text
    assert same_answer(direct.json(), invoked.json())
    live_server.assert_idle_and_clean()


def test_a_streamed_chat_streams_through_invocations(http: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0.0}
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    text = ""
    with http.stream("POST", "/invocations", json={**body, "stream": True}) as events:
        assert events.headers["content-type"].startswith("text/event-stream")
        for line in events.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[len("data: "):])["choices"]:
                    text += choice["delta"].get("content") or ""
    assert text == whole


@pytest.mark.parametrize(("body", "param", "message"), [
    ({}, None, "none of the requests /invocations serves"),
    ({"max_tokens": 3}, None, "none of the requests /invocations serves"),
    ({"messages": [{"role": "user", "content": "Hi"}], "temperature": "hot"}, "temperature", "temperature"),
    ({"prompt": "Hi", "max_tokens": -1}, "max_tokens", "max_tokens"),
])
def test_a_body_it_cannot_serve_is_a_400_naming_why(http: httpx.Client, body: dict[str, Any], param: str | None,
                                                   message: str) -> None:
    reply = http.post("/invocations", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error.get("param") == param, error
    for raw in (b"[1, 2]", b"not json"):
        reply = http.post("/invocations", content=raw, headers={"content-type": "application/json"})
        assert reply.status_code == 400 and "JSON" in reply.json()["error"]["message"]


def test_ping_is_the_health_check(http: httpx.Client) -> None:
    for method in ("GET", "POST"):
        reply = http.request(method, "/ping")
        assert reply.status_code == 200 and reply.json() == {"status": "ok"}
