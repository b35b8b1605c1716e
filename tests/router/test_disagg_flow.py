"""The disaggregated router's requests against scripted prefill and decode instances:
the two legs, the 4xx passthrough, the fallbacks, prompt logprobs, the other routes."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from disagg_harness import DECODE_A, DECODE_B, PREFILL_A, PREFILL_B, DisaggRouters, FakeInstances, kv_params
from router_harness import samples, wait_for, worker_of

from kvloom.router.disagg import prefill_body, wants_prompt_logprobs
from kvloom.router.main import BackgroundRouter

ROLES = {PREFILL_A: "prefill", DECODE_A: "decode"}


@pytest.fixture
def run_disagg() -> Iterator[DisaggRouters]:
    with DisaggRouters() as start:
        yield start


def post(router: BackgroundRouter, path: str = "/v1/completions", **body: Any) -> httpx.Response:
    return httpx.post(f"{router.base_url}{path}", json=body, timeout=30)


def metric(router: BackgroundRouter, name: str, **labels: str) -> float:
    return samples(httpx.get(f"{router.base_url}/metrics").text).get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_streamed_request_goes_through_prefill_then_decode(run_disagg: DisaggRouters) -> None:
    instances = FakeInstances(ROLES)
    router = run_disagg(instances)
    body = {"prompt": "Tell me of ships", "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{router.base_url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200 and worker_of(response) == DECODE_A
        lines = [line for line in response.iter_lines() if line]
    # The client gets the decode instance's stream, event by event.
    assert [json.loads(line.removeprefix("data: "))["choices"][0]["text"] for line in lines[:-1]] == ["Ahoy", " there"]
    assert lines[-1] == "data: [DONE]"
    # The prefill leg: not streamed, no stream options, asked to keep the KV for a decode instance.
    assert instances.at(PREFILL_A) == [{"prompt": "Tell me of ships", "max_tokens": 8, "stream": False,
                                        "kv_transfer_params": {"do_remote_decode": True}}]
    # The decode leg: the client's body as sent, plus the prefill's kv_transfer_params.
    assert instances.at(DECODE_A) == [{**body, "kv_transfer_params": kv_params(PREFILL_A)}]
    assert metric(router, "kvloom_router_disagg_requests_total", role="prefill") == 1
    assert metric(router, "kvloom_router_disagg_requests_total", role="decode") == 1
    assert metric(router, "kvloom_router_prefill_seconds_count") == 1
    wait_for(lambda: metric(router, "kvloom_router_requests_in_flight", worker=DECODE_A) == 0, what="released")
    assert metric(router, "kvloom_router_requests_in_flight", worker=PREFILL_A) == 0


def test_a_whole_chat_request_goes_through_both_legs(run_disagg: DisaggRouters) -> None:
    instances = FakeInstances(ROLES)
    router = run_disagg(instances)
    messages = [{"role": "user", "content": "Which ship?"}]
    response = post(router, "/v1/chat/completions", messages=messages, max_tokens=4)
    assert response.status_code == 200 and worker_of(response) == DECODE_A
    assert response.json()["choices"][0]["text"] == "Ahoy there"
    assert [p.path for p in instances.posts] == ["/v1/chat/completions"] * 2
    assert instances.at(PREFILL_A)[0]["stream"] is False
    assert instances.at(DECODE_A) == [{"messages": messages, "max_tokens": 4,
                                       "kv_transfer_params": kv_params(PREFILL_A)}]


def test_a_prefill_4xx_is_the_clients_answer(run_disagg: DisaggRouters) -> None:
    bad = {"error": {"message": "max_tokens must be >= 1", "type": "invalid_request_error",
                     "param": "max_tokens", "code": None}}
    instances = FakeInstances(ROLES, {PREFILL_A: lambda r: httpx.Response(400, json=bad)})
    router = run_disagg(instances)
    response = post(router, prompt="x", max_tokens=-1)
    assert response.status_code == 400 and response.json() == bad
    assert worker_of(response) == PREFILL_A
    assert instances.at(DECODE_A) == []  # the request itself is bad: no decode leg
    assert metric(router, "kvloom_router_disagg_fallbacks_total", reason="prefill_error") == 0


def test_with_the_prefill_down_the_decode_instance_prefills_itself(
        run_disagg: DisaggRouters, caplog: pytest.LogCaptureFixture) -> None:
    instances = FakeInstances(ROLES)
    router = run_disagg(instances)
    instances.down.add(PREFILL_A)
    with caplog.at_level(logging.WARNING, logger="kvloom.router.disagg"):
        response = post(router, prompt="hello", max_tokens=4)
    assert response.status_code == 200 and worker_of(response) == DECODE_A
    assert instances.at(DECODE_A) == [{"prompt": "hello", "max_tokens": 4}]  # no kv_transfer_params
    assert metric(router, "kvloom_router_disagg_fallbacks_total", reason="no_prefill_worker") == 1
    assert metric(router, "kvloom_router_unroutable_total") == 0  # it was served
    fallbacks = [r.getMessage() for r in caplog.records if r.name == "kvloom.router.disagg"]
    assert len(fallbacks) == 1 and "no_prefill_worker" in fallbacks[0]
    health = httpx.get(f"{router.base_url}/health")
    assert health.status_code == 200  # a decode instance serves alone
    assert health.json()["prefill"] == {PREFILL_A: "down"} and health.json()["decode"] == {DECODE_A: "up"}


@pytest.mark.parametrize(("answer", "reason"), [
    (httpx.Response(500, json={"error": {"message": "boom", "code": None}}), "prefill_error"),
    (httpx.Response(503, json={"error": {"message": "full", "code": "server_overloaded"}}), "prefill_error"),
    (httpx.Response(200, json={"id": "c", "choices": []}), "no_kv_transfer_params"),
    (httpx.Response(200, json={"id": "c", "kv_transfer_params": "not an object"}), "no_kv_transfer_params"),
])
def test_a_failed_prefill_falls_back_to_decode(run_disagg: DisaggRouters, answer: httpx.Response,
                                               reason: str) -> None:
    instances = FakeInstances(ROLES, {PREFILL_A: lambda r: answer})
    router = run_disagg(instances)
    # The client's own kv_transfer_params are not passed on: they are the router's to give.
    response = post(router, prompt="hello", stream=True, kv_transfer_params={"do_remote_prefill": True})
    assert response.status_code == 200 and worker_of(response) == DECODE_A
    assert response.text.endswith("data: [DONE]\n\n")
    assert instances.at(DECODE_A) == [{"prompt": "hello", "stream": True}]
    assert metric(router, "kvloom_router_disagg_fallbacks_total", reason=reason) == 1
    assert metric(router, "kvloom_router_prefill_seconds_count") == 0


def test_a_refused_prefill_is_retried_on_another_prefill_instance(run_disagg: DisaggRouters) -> None:
    instances = FakeInstances({PREFILL_A: "prefill", PREFILL_B: "prefill", DECODE_A: "decode"})
    router = run_disagg(instances, policy="round_robin")
    instances.down.add(PREFILL_A)
    response = post(router, prompt="hello")
    assert response.status_code == 200
    assert instances.at(DECODE_A) == [{"prompt": "hello", "kv_transfer_params": kv_params(PREFILL_B)}]
    assert metric(router, "kvloom_router_retries_total", reason="connect", worker=PREFILL_A) == 1
    assert metric(router, "kvloom_router_disagg_fallbacks_total", reason="no_prefill_worker") == 0


def test_the_prefill_pool_is_routed_by_prefix_and_decode_by_load(run_disagg: DisaggRouters) -> None:
    instances = FakeInstances({PREFILL_A: "prefill", PREFILL_B: "prefill", DECODE_A: "decode",
                               DECODE_B: "decode"})
    router = run_disagg(instances)
    system = "You are a pirate. Answer every question as a pirate would, briefly and loudly. "
    for i in range(4):
        assert post(router, prompt=f"{system}Question {i}?").status_code == 200
    prefills = [p.url for p in instances.posts if instances.roles[p.url] == "prefill"]
    decodes = [p.url for p in instances.posts if instances.roles[p.url] == "decode"]
    assert len(set(prefills)) == 1  # cache_aware: the shared prefix stays on one prefill instance
    assert sorted(decodes) == [DECODE_A, DECODE_A, DECODE_B, DECODE_B]  # idle decode instances take turns
    assert post(router, prompt="Something else entirely, with nothing shared").status_code == 200
    assert instances.posts[-2].url != prefills[0]  # a miss goes to the other prefill instance


@pytest.mark.parametrize("fields", [{"prompt_logprobs": 0}, {"prompt_logprobs": 2},
                                    {"echo": True, "logprobs": 1}])
def test_prompt_logprobs_skip_the_prefill_instance(run_disagg: DisaggRouters, fields: dict[str, Any]) -> None:
    instances = FakeInstances(ROLES)
    router = run_disagg(instances)
    response = post(router, prompt="score me", **fields)
    assert response.status_code == 200 and worker_of(response) == DECODE_A
    assert instances.at(PREFILL_A) == []
    assert instances.at(DECODE_A) == [{"prompt": "score me", **fields}]
    assert metric(router, "kvloom_router_disagg_prefill_skipped_total", reason="prompt_logprobs") == 1
    assert metric(router, "kvloom_router_disagg_fallbacks_total", reason="no_prefill_worker") == 0


def test_a_beam_search_skips_the_prefill_instance(run_disagg: DisaggRouters) -> None:
    instances = FakeInstances(ROLES)
    router = run_disagg(instances)
    fields = {"use_beam_search": True, "n": 2}
    response = post(router, prompt="search me", **fields)
    assert response.status_code == 200 and worker_of(response) == DECODE_A
    assert instances.at(PREFILL_A) == [] and instances.at(DECODE_A) == [{"prompt": "search me", **fields}]
    assert metric(router, "kvloom_router_disagg_prefill_skipped_total", reason="beam_search") == 1


def test_a_responses_continuation_goes_to_the_decode_instance_that_stored_it(run_disagg: DisaggRouters) -> None:
    """Only decode-b holds resp_b (GET answers 200 there, 404 elsewhere): the request that
    continues it skips the prefill leg (the prefill instance has no conversation to
    prefill) and goes to decode-b, though decode-a is as little loaded."""
    def holds(url: str) -> Any:
        def handle(request: httpx.Request) -> httpx.Response:
            if request.method == "GET":
                found = url == DECODE_B and request.url.path == "/v1/responses/resp_b"
                return httpx.Response(200 if found else 404, json={"id": "resp_b"} if found else {})
            return httpx.Response(200, json={"id": "resp_c", "object": "response", "output": []})
        return handle

    instances = FakeInstances({PREFILL_A: "prefill", DECODE_A: "decode", DECODE_B: "decode"},
                              {DECODE_A: holds(DECODE_A), DECODE_B: holds(DECODE_B)})
    router = run_disagg(instances)
    for _ in range(2):
        response = post(router, "/v1/responses", input="and then?", previous_response_id="resp_b")
        assert response.status_code == 200 and worker_of(response) == DECODE_B
    assert instances.at(PREFILL_A) == []
    continued = [p.body for p in instances.posts if p.path == "/v1/responses"]
    assert continued == [{"input": "and then?", "previous_response_id": "resp_b"}] * 2
    assert metric(router, "kvloom_router_disagg_prefill_skipped_total", reason="previous_response") == 2
    fetched = httpx.get(f"{router.base_url}/v1/responses/resp_b", timeout=30)
    assert fetched.status_code == 200 and worker_of(fetched) == DECODE_B


def test_what_asks_for_prompt_logprobs() -> None:
    assert wants_prompt_logprobs({"prompt_logprobs": 0})
    assert wants_prompt_logprobs({"echo": True, "logprobs": 0})
    assert wants_prompt_logprobs({"echo": True, "logprobs": True})  # chat's spelling
    assert not wants_prompt_logprobs({"logprobs": 5})  # output logprobs only
    assert not wants_prompt_logprobs({"echo": True})
    assert not wants_prompt_logprobs({"echo": True, "logprobs": False, "prompt_logprobs": None})
    body = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True},
            "kv_transfer_params": {"client": "sent"}}
    assert prefill_body(body) == {"prompt": "x", "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    assert body["stream"] is True  # the client's body is not changed


def test_a_body_that_is_not_json_goes_to_decode_for_its_error(run_disagg: DisaggRouters) -> None:
    refusal = {"error": {"message": "not JSON", "type": "invalid_request_error", "param": None, "code": None}}
    instances = FakeInstances(ROLES, {DECODE_A: lambda r: httpx.Response(400, json=refusal)})
    router = run_disagg(instances)
    response = httpx.post(f"{router.base_url}/v1/completions", content=b"{not json", timeout=30)
    assert response.status_code == 400 and response.json() == refusal and worker_of(response) == DECODE_A
    assert [p.url for p in instances.posts] == [DECODE_A]


def test_other_routes_go_to_decode_and_health_needs_a_decode_instance(run_disagg: DisaggRouters) -> None:
    tokens = {"tokens": [1, 2], "count": 2, "max_model_len": 256}
    instances = FakeInstances(ROLES, {PREFILL_A: lambda r: httpx.Response(500),
                                      DECODE_A: lambda r: httpx.Response(200, json=tokens)})
    router = run_disagg(instances)
    response = post(router, "/tokenize", prompt="hi")
    assert response.status_code == 200 and response.json() == tokens and worker_of(response) == DECODE_A
    models = httpx.get(f"{router.base_url}/v1/models")
    assert models.status_code == 200 and worker_of(models) == DECODE_A
    assert [p.url for p in instances.posts] == [DECODE_A]
    instances.down.add(DECODE_A)
    assert post(router, "/tokenize", prompt="hi").status_code == 503  # marks it down
    health = httpx.get(f"{router.base_url}/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "no_worker_available"
    assert "decode" in health.json()["error"]["message"]
    assert health.json()["workers"] == {PREFILL_A: "up", DECODE_A: "down"}


def test_with_no_decode_instance_up_a_request_is_a_503(run_disagg: DisaggRouters) -> None:
    instances = FakeInstances(ROLES)
    router = run_disagg(instances)
    instances.down.add(DECODE_A)
    response = post(router, prompt="hello")
    assert response.status_code == 503 and response.json()["error"]["code"] == "no_worker_available"
    assert DECODE_A in response.json()["error"]["message"]
    assert len(instances.at(PREFILL_A)) == 1  # the prefill leg ran; its KV is the instance's to drop


def test_a_client_that_leaves_during_the_prefill_leg_aborts_it(run_disagg: DisaggRouters) -> None:
    cancelled = threading.Event()

    async def held(request: httpx.Request) -> httpx.Response:
        try:
            await asyncio.Event().wait()  # never set: only the client's leaving ends it
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    instances = FakeInstances(ROLES, {PREFILL_A: held})
    router = run_disagg(instances)
    body = json.dumps({"prompt": "hello", "stream": True}).encode()
    host, port = router.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: len(instances.at(PREFILL_A)) == 1, what="the prefill leg under way")
    wait_for(cancelled.is_set, what="the prefill leg cancelled")
    wait_for(lambda: metric(router, "kvloom_router_requests_in_flight", worker=PREFILL_A) == 0, what="released")
    assert instances.at(DECODE_A) == []
