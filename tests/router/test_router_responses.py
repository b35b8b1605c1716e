"""Stored responses behind the router: two live workers with --enable-responses-store
(tiny model) and a round-robin router, so that consecutive requests land on both and
half of the requests about a response would reach the worker that does not hold it, if
the router did not send them to the one that stored it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_harness import samples, start_router, start_worker, wait_for, worker_of

from kvloom.router.main import BackgroundRouter
from kvloom.server.background import BackgroundServer as LiveServer

GREEDY: dict[str, Any] = {"model": "tiny", "max_output_tokens": 6, "temperature": 0.0}


@pytest.fixture(scope="module")
def workers(tiny_llama: Path) -> Iterator[list[LiveServer]]:
    live = [start_worker(tiny_llama, enable_responses_store=True) for _ in range(2)]
    yield live
    for worker in live:
        worker.stop()


@pytest.fixture(scope="module")
def router(workers: list[LiveServer]) -> Iterator[BackgroundRouter]:
    live = start_router([w.base_url for w in workers], policy="round_robin")
    yield live
    live.stop()


def stored_decisions(http: httpx.Client) -> float:
    return sum(value for (name, labels), value in samples(http.get("/metrics").text).items()
               if name == "kvloom_router_requests_total" and ("decision", "stored_response") in labels)


def test_each_response_is_fetched_and_deleted_on_the_worker_that_stored_it(
        http: httpx.Client, workers: list[LiveServer]) -> None:
    created = [http.post("/v1/responses", json={**GREEDY, "input": f"question {i}"}) for i in range(4)]
    owners = [worker_of(r) for r in created]
    assert set(owners) == {w.base_url for w in workers}  # both workers hold some
    before = stored_decisions(http)
    for response, owner in zip(created, owners, strict=True):
        fetched = http.get(f"/v1/responses/{response.json()['id']}")
        assert fetched.status_code == 200 and worker_of(fetched) == owner
        assert fetched.json() == response.json()
    assert stored_decisions(http) - before == 4
    gone = created[1].json()["id"]
    deleted = http.delete(f"/v1/responses/{gone}")
    assert worker_of(deleted) == owners[1] and deleted.json() == {"id": gone, "object": "response", "deleted": True}
    for response_id in (gone, "resp_never_stored"):  # held by no worker: a worker's own 404 names it
        missing = http.get(f"/v1/responses/{response_id}")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "response_not_found"
        assert response_id in missing.json()["error"]["message"]


def test_a_chain_of_continuations_stays_on_its_worker_and_answers_the_conversation(
        http: httpx.Client, workers: list[LiveServer]) -> None:
    first = http.post("/v1/responses", json={**GREEDY, "input": "hello there"})
    owner = worker_of(first)
    other = next(w.base_url for w in workers if w.base_url != owner)
    conversation: list[dict[str, Any]] = [{"role": "user", "content": "hello there"}]
    previous = first.json()
    for turn in ("and then?", "why?", "tell me more"):
        conversation += [{"role": "assistant", "content": previous["output"][0]["content"][0]["text"]},
                         {"role": "user", "content": turn}]
        answer = http.post("/v1/responses", json={**GREEDY, "input": turn, "previous_response_id": previous["id"]})
        assert answer.status_code == 200 and worker_of(answer) == owner
        # The same conversation sent whole to the other worker (stateless) answers the same.
        whole = httpx.post(f"{other}/v1/responses", json={**GREEDY, "input": conversation, "store": False},
                           timeout=60).json()
        assert answer.json()["output"][0]["content"][0]["text"] == whole["output"][0]["content"][0]["text"]
        assert answer.json()["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
        previous = answer.json()
    # Streamed, a continuation goes to the owner as well.
    with http.stream("POST", "/v1/responses", json={**GREEDY, "input": "bye", "stream": True,
                                                    "previous_response_id": previous["id"]}) as streamed:
        assert streamed.status_code == 200 and worker_of(streamed) == owner
        kinds = [line.removeprefix("event: ") for line in streamed.iter_lines() if line.startswith("event: ")]
        assert kinds[-1] == "response.incomplete"  # its 6 tokens all given: ended by max_output_tokens
    refused = http.post("/v1/responses", json={**GREEDY, "input": "hi", "previous_response_id": "resp_nowhere"})
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "previous_response_id"
    for worker in workers:
        worker.assert_idle_and_clean()


def test_a_background_response_is_polled_and_cancelled_on_its_worker(http: httpx.Client,
                                                                      workers: list[LiveServer]) -> None:
    queued = http.post("/v1/responses", json={**GREEDY, "input": "hello there", "background": True})
    assert queued.json()["status"] == "queued"
    response_id, owner = queued.json()["id"], worker_of(queued)
    polled: list[httpx.Response] = []

    def ended() -> bool:
        polled.append(http.get(f"/v1/responses/{response_id}"))
        return polled[-1].json()["status"] not in ("queued", "in_progress")

    wait_for(ended, timeout=30, what="the background response to end")
    assert {worker_of(p) for p in polled} == {owner} and polled[-1].json()["output"]
    cancelled = http.post(f"/v1/responses/{response_id}/cancel")  # ended: returned as it is
    assert worker_of(cancelled) == owner and cancelled.json() == polled[-1].json()


def test_a_streamed_background_response_streams_again_through_the_router(http: httpx.Client) -> None:
    body = {**GREEDY, "input": "hello there", "background": True, "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as first:
        owner = worker_of(first)
        events = [line for line in first.iter_lines() if line.startswith("data: ")]
    response_id = json.loads(events[0].removeprefix("data: "))["response"]["id"]
    with http.stream("GET", f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": 1}) as again:
        assert again.status_code == 200 and worker_of(again) == owner
        assert again.headers["content-type"].startswith("text/event-stream")
        assert [line for line in again.iter_lines() if line.startswith("data: ")] == events[2:]
