"""Two live kvloom workers on loopback (tiny model) behind a live router."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from router_harness import (
    SYSTEM_LAWYER,
    SYSTEM_PIRATE,
    completion,
    samples,
    start_router,
    start_worker,
    wait_for,
    worker_of,
)

from kvloom.router.main import BackgroundRouter
from kvloom.server.background import BackgroundServer as LiveServer


@pytest.fixture(scope="module")
def workers(tiny_llama: Path) -> Iterator[list[LiveServer]]:
    live = [start_worker(tiny_llama) for _ in range(2)]
    yield live
    for worker in live:
        worker.stop()


@pytest.fixture(scope="module")
def router(workers: list[LiveServer]) -> Iterator[BackgroundRouter]:
    live = start_router([w.base_url for w in workers])
    yield live
    live.stop()


def test_shared_system_prompts_land_on_one_worker_each(http: httpx.Client, workers: list[LiveServer]) -> None:
    pirate = [completion(http, f"{SYSTEM_PIRATE}Question {i}: where is the gold?") for i in range(6)]
    lawyer = [completion(http, f"{SYSTEM_LAWYER}Question {i}: may I keep it?") for i in range(6)]
    assert all(r.status_code == 200 for r in pirate + lawyer), [r.text for r in pirate + lawyer]
    pirate_workers = {worker_of(r) for r in pirate}
    lawyer_workers = {worker_of(r) for r in lawyer}
    assert len(pirate_workers) == 1 and len(lawyer_workers) == 1
    assert pirate_workers != lawyer_workers  # a new system prompt goes to the emptier worker
    # The workers' own prefix caches agree: every request after the first hit.
    for responses in (pirate, lawyer):
        cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses]
        assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    decisions = samples(http.get("/metrics").text)
    hits = sum(v for (name, labels), v in decisions.items()
               if name == "kvloom_router_requests_total" and ("decision", "cache_hit") in labels)
    assert hits >= 10


def test_concurrent_requests_all_answered(http: httpx.Client) -> None:
    prompts = [f"{(SYSTEM_PIRATE, SYSTEM_LAWYER)[i % 2]}Concurrent question {i}?" for i in range(16)]
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda p: completion(http, p), prompts))
    assert [r.status_code for r in responses] == [200] * 16
    assert len({worker_of(r) for r in responses}) == 2


def test_streaming_passes_through_the_same_text(http: httpx.Client, workers: list[LiveServer]) -> None:
    body = {"prompt": f"{SYSTEM_PIRATE}Tell me a story.", "max_tokens": 12, "temperature": 0.0,
            "ignore_eos": True, "stream": True}

    def streamed_text(client: httpx.Client) -> tuple[str, list[str]]:
        events = []
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
        assert events[-1] == "[DONE]"
        return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]), events

    via_router, events = streamed_text(http)
    with httpx.Client(base_url=workers[0].base_url, timeout=60) as direct_client:
        direct, _ = streamed_text(direct_client)
    assert via_router == direct and len(events) > 3


def test_worker_errors_pass_through(http: httpx.Client, workers: list[LiveServer]) -> None:
    bad = {"prompt": "hi", "temperature": -1}
    via_router = http.post("/v1/completions", json=bad)
    direct = httpx.post(f"{workers[0].base_url}/v1/completions", json=bad)
    assert via_router.status_code == direct.status_code == 400
    assert via_router.json() == direct.json()
    unknown = http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": [{"role": "user",
                                                                                        "content": "hi"}]})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    not_json = http.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]["message"]
    assert http.get("/v1/nothing").status_code == 404


def test_models_health_and_version(http: httpx.Client, workers: list[LiveServer]) -> None:
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["block_size"] == 16
    health = http.get("/health")
    assert health.status_code == 200
    assert health.json()["workers"] == {w.base_url: "up" for w in workers}
    assert "version" in http.get("/version").json()


def test_metrics_sum_the_workers(http: httpx.Client, workers: list[LiveServer]) -> None:
    completion(http, f"{SYSTEM_LAWYER}One more?")
    for worker in workers:
        worker.wait_until_idle()
    # Idle workers: their counters stand still while both sides are read.
    wait_for(lambda: all(w.snapshot().num_active_requests == 0 for w in workers), what="idle workers")
    per_worker = [samples(httpx.get(f"{w.base_url}/metrics").text) for w in workers]
    routed = samples(http.get("/metrics").text)
    counters = {key for s in per_worker for key in s
                if key[0].endswith(("_total", "_count", "_sum", "_bucket")) and key[0].startswith("kvloom:")}
    assert ("kvloom:prefix_cache_hits_total", ()) in counters
    for key in counters:
        assert routed[key] == pytest.approx(sum(s.get(key, 0.0) for s in per_worker)), key
    assert routed[("kvloom:prompt_tokens_total", ())] > 0
    for worker in workers:
        assert routed[("kvloom_router_worker_up", (("worker", worker.base_url),))] == 1
        assert routed[("kvloom_router_requests_in_flight", (("worker", worker.base_url),))] == 0


def test_reset_prefix_cache_reaches_every_worker(http: httpx.Client, workers: list[LiveServer]) -> None:
    prompt = f"{SYSTEM_PIRATE}Question 99: how deep is the sea?"
    assert completion(http, prompt).status_code == 200
    assert completion(http, prompt).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    response = http.post("/reset_prefix_cache")
    assert response.status_code == 200
    assert response.json() == {"reset": True, "workers": {w.base_url: True for w in workers}}
    assert completion(http, prompt).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_embeddings_pass_through(http: httpx.Client) -> None:
    response = http.post("/v1/embeddings", json={"input": ["a b c", "d e"], "encoding_format": "float"})
    assert response.status_code == 200, response.text
    assert [len(d["embedding"]) for d in response.json()["data"]] == [64, 64]


def test_score_and_rerank_pass_through(http: httpx.Client) -> None:
    scored = http.post("/score", json={"text_1": "a b c", "text_2": ["a b c", "d e"]})
    assert scored.status_code == 200, scored.text
    assert scored.json()["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)  # a text against itself
    ranked = http.post("/v1/rerank", json={"query": "a b c", "documents": ["d e", "a b c"]})
    assert ranked.status_code == 200 and ranked.json()["results"][0]["index"] == 1


def test_a_model_card_passes_through(http: httpx.Client) -> None:
    assert http.get("/v1/models/tiny").json()["id"] == "tiny"
    assert http.get("/v1/models/gpt-9").status_code == 404


def test_anthropic_messages_pass_through(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "hello"}]
    reply = http.post("/v1/messages", json={"model": "tiny", "max_tokens": 3, "messages": messages})
    assert reply.status_code == 200, reply.text
    assert reply.json()["type"] == "message" and 1 <= reply.json()["usage"]["output_tokens"] <= 3
    counted = http.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": messages})
    usage = reply.json()["usage"]
    assert counted.json()["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]
