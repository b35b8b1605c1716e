"""The router against scripted workers (httpx.MockTransport): retries, broken streams,
health, load balancing under held requests, and the startup checks."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
from router_harness import samples, wait_for, worker_of

from kvloom.router.config import RouterConfig
from kvloom.router.main import BackgroundRouter, bind_socket, start_background_router
from kvloom.router.policy import PolicyConfig
from kvloom.router.workers import RouterStartupError, check_workers
from kvloom.server.settings import CorsSettings

A, B = "http://worker-a:1", "http://worker-b:1"
Handler = Callable[[httpx.Request], Any]


def models(name: str = "tiny", block_size: int = 16, max_model_len: int = 256) -> httpx.Response:
    return httpx.Response(200, json={"object": "list", "data": [
        {"id": name, "object": "model", "max_model_len": max_model_len, "block_size": block_size}]})


def completion_body(text: str) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": text}]}


class ScriptedWorkers:
    """Per worker URL, a handler for POSTs; /health and /v1/models answer as a kvloom
    worker does unless ``down`` holds the worker."""

    def __init__(self, handlers: dict[str, Handler]) -> None:
        self.handlers = handlers
        self.down: set[str] = set()
        self.seen: list[str] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if url in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if request.url.path == "/v1/models":
            return models()
        if request.url.path == "/metrics":
            return httpx.Response(200, text="")
        self.seen.append(url)
        result = self.handlers[url](request)
        return await result if asyncio.iscoroutine(result) else result


def ok(text: str) -> Handler:
    return lambda request: httpx.Response(200, json=completion_body(text))


@pytest.fixture
def run_router() -> Iterator[Callable[..., BackgroundRouter]]:
    started: list[BackgroundRouter] = []

    def start(workers: ScriptedWorkers, policy: str = "cache_aware", **kwargs: Any) -> BackgroundRouter:
        config = RouterConfig((A, B), policy=policy, health_interval=kwargs.pop("health_interval", 60.0),
                              **kwargs)
        router = start_background_router(config, httpx.MockTransport(workers))
        started.append(router)
        return router

    yield start
    for router in started:
        router.stop()


def post(router: BackgroundRouter, prompt: str = "hello", **fields: Any) -> httpx.Response:
    return httpx.post(f"{router.base_url}/v1/completions", json={"prompt": prompt, **fields}, timeout=30)


def test_refused_connection_is_retried_elsewhere_and_the_worker_marked_down(run_router: Any) -> None:
    workers = ScriptedWorkers({A: ok("from a"), B: ok("from b")})
    router = run_router(workers, policy="round_robin")
    workers.down.add(A)
    responses = [post(router) for _ in range(4)]
    assert [r.json()["choices"][0]["text"] for r in responses] == ["from b"] * 4
    assert {worker_of(r) for r in responses} == {B}
    health = httpx.get(f"{router.base_url}/health").json()
    assert health["workers"] == {A: "down", B: "up"}
    metrics = samples(httpx.get(f"{router.base_url}/metrics").text)
    assert metrics[("kvloom_router_retries_total", (("reason", "connect"), ("worker", A)))] == 1
    assert metrics[("kvloom_router_worker_up", (("worker", A),))] == 0


def test_not_ready_is_retried_and_other_errors_pass_through(run_router: Any) -> None:
    not_ready = {"error": {"message": "loading", "type": "server_error", "param": None, "code": "model_not_ready"}}
    full = {"error": {"message": "full", "type": "server_error", "param": None, "code": "server_overloaded"}}
    workers = ScriptedWorkers({A: lambda r: httpx.Response(503, json=not_ready),
                               B: lambda r: httpx.Response(503, json=full, headers={"Retry-After": "1"})})
    router = run_router(workers, policy="round_robin")
    response = post(router)
    # A never started it (loading), so B got it; B's overload is B's answer, passed through.
    assert workers.seen == [A, B]
    assert response.status_code == 503 and response.json() == full
    assert response.headers["retry-after"] == "1"


def test_early_close_tries_the_same_worker_once_more(run_router: Any) -> None:
    calls: list[int] = []

    def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) == 1:  # a keep-alive connection the worker just closed
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, json=completion_body("second try"))

    workers = ScriptedWorkers({A: flaky, B: flaky})
    router = run_router(workers, policy="least_loaded")
    assert post(router).json()["choices"][0]["text"] == "second try"
    assert httpx.get(f"{router.base_url}/health").json()["workers"] == {A: "up", B: "up"}


def test_a_broken_stream_ends_with_an_error_event_then_done(run_router: Any) -> None:
    first = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "Ahoy"}]}

    async def events() -> AsyncIterator[bytes]:
        yield f"data: {json.dumps(first)}\n\n".encode()
        yield b'data: {"id": "c", "choi'  # half an event, then the worker dies
        raise httpx.ReadError("connection reset by peer")

    workers = ScriptedWorkers({A: lambda r: httpx.Response(200, headers={"content-type": "text/event-stream"},
                                                           content=events()), B: ok("unused")})
    router = run_router(workers, policy="round_robin")
    with httpx.stream("POST", f"{router.base_url}/v1/completions", json={"prompt": "x", "stream": True}) as r:
        assert r.status_code == 200 and worker_of(r) == A
        lines = [line for line in r.iter_lines() if line]
    assert lines[0] == f"data: {json.dumps(first)}"
    error = json.loads(lines[1].removeprefix("data: "))["error"]
    assert error["code"] == "worker_failed" and A in error["message"]
    assert lines[2:] == ["data: [DONE]"]
    assert workers.seen == [A]  # it had started: never retried
    wait_for(lambda: samples(httpx.get(f"{router.base_url}/metrics").text)[
        ("kvloom_router_requests_in_flight", (("worker", A),))] == 0, what="stream released")


def test_a_broken_whole_response_is_a_502(run_router: Any) -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b'{"id": "c", '
        raise httpx.ReadError("connection reset by peer")

    workers = ScriptedWorkers({A: lambda r: httpx.Response(200, content=body()), B: ok("unused")})
    router = run_router(workers, policy="round_robin")
    response = post(router)
    assert response.status_code == 502 and response.json()["error"]["code"] == "worker_failed"
    assert workers.seen == [A]


def test_no_worker_up_is_a_503_naming_what_was_tried(run_router: Any) -> None:
    workers = ScriptedWorkers({A: ok("a"), B: ok("b")})
    router = run_router(workers)
    workers.down |= {A, B}
    response = post(router)
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "no_worker_available" and A in error["message"] and B in error["message"]
    assert httpx.get(f"{router.base_url}/health").status_code == 503


def test_health_checks_take_a_worker_out_and_back(run_router: Any) -> None:
    workers = ScriptedWorkers({A: ok("a"), B: ok("b")})
    router = run_router(workers, health_interval=0.05)
    health = f"{router.base_url}/health"
    workers.down.add(B)
    wait_for(lambda: httpx.get(health).json()["workers"][B] == "down", what="B down")
    assert {worker_of(post(router, f"prompt {i}")) for i in range(4)} == {A}
    workers.down.clear()
    wait_for(lambda: httpx.get(health).json()["workers"][B] == "up", what="B up again")


def test_a_loaded_worker_gives_way_to_the_least_loaded(run_router: Any) -> None:
    release = threading.Event()

    async def held(request: httpx.Request) -> httpx.Response:
        while not release.is_set():  # polled: the handler runs on the router's event loop
            await asyncio.sleep(0.005)
        return httpx.Response(200, json=completion_body("done"))

    workers = ScriptedWorkers({A: held, B: held})
    router = run_router(workers, policy_config=PolicyConfig(balance_abs_threshold=2, balance_rel_threshold=1.0))
    prompt = "The same long system prompt for everyone. " * 4
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda i=i: results.append(post(router, f"{prompt}{i}"))) for i in range(6)]
    for i, thread in enumerate(threads):
        thread.start()
        wait_for(lambda i=i: len(workers.seen) == i + 1, what=f"request {i} at a worker")
    release.set()
    for thread in threads:
        thread.join(timeout=30)
    metrics = samples(httpx.get(f"{router.base_url}/metrics").text)
    home = workers.seen[0]
    # Hits stay home until it has 3 in flight against 0 (more than 2 above); then the other.
    assert workers.seen[:3] == [home] * 3 and workers.seen[3] != home
    assert sum(v for (name, labels), v in metrics.items()
               if name == "kvloom_router_requests_total" and ("decision", "load_balance") in labels) >= 1
    assert [r.status_code for r in results] == [200] * 6


# ---- startup -----------------------------------------------------------------------------
def check(responses: dict[str, httpx.Response | None], **config: Any) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        response = responses[f"{request.url.scheme}://{request.url.host}:{request.url.port}"]
        if response is None:
            raise httpx.ConnectError("connection refused", request=request)
        return response
    asyncio.run(check_workers(RouterConfig(tuple(responses), **config), httpx.MockTransport(handler)))


def test_startup_names_mismatched_models_and_block_sizes() -> None:
    with pytest.raises(RouterStartupError, match=f"model: {A} has 'tiny', {B} has 'other'"):
        check({A: models("tiny"), B: models("other")})
    with pytest.raises(RouterStartupError, match=f"block size: {A} has 16, {B} has 32"):
        check({A: models(block_size=16), B: models(block_size=32)})
    with pytest.raises(RouterStartupError, match="max model len"):
        check({A: models(max_model_len=256), B: models(max_model_len=512)})
    check({A: models(), B: models()})  # agreeing workers pass


def test_startup_fails_after_the_deadline_for_an_unreachable_worker() -> None:
    with pytest.raises(RouterStartupError, match=f"worker {B} did not answer .* is it running"):
        check({A: models(), B: None}, startup_timeout=0.3)
    loading = httpx.Response(503, json={"error": {"code": "model_not_ready"}})
    with pytest.raises(RouterStartupError, match="still loading"):
        check({A: models(), B: loading}, startup_timeout=0.3)


def test_startup_names_a_missing_api_key_and_a_non_kvloom_server() -> None:
    with pytest.raises(RouterStartupError, match="requires an API key"):
        check({A: httpx.Response(401, json={}), B: models()})
    with pytest.raises(RouterStartupError, match="is it a kvloom server"):
        check({A: models(), B: httpx.Response(404, text="nope")})
    with pytest.raises(RouterStartupError, match="not a model list"):
        check({A: models(), B: httpx.Response(200, text="<html>")})


def test_a_port_in_use_is_named() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(RouterStartupError, match=f"port {port} on 127.0.0.1 is already in use"):
            bind_socket("127.0.0.1", port)
    finally:
        taken.close()


def test_browsers_may_call_the_router_as_they_may_a_server(run_router: Any) -> None:
    """CORS at the router, with the server's flags and defaults: a preflight is answered
    there (no worker sees it), replies name the origin as allowed; narrowed, other origins
    are refused their preflight and get no allow header."""
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    workers = ScriptedWorkers({A: ok("a"), B: ok("b")})
    router = run_router(workers)
    answered = httpx.options(f"{router.base_url}/v1/completions", headers=preflight, timeout=30)
    assert (answered.status_code, answered.headers["access-control-allow-origin"]) == (200, "*")
    assert workers.seen == []  # no worker was asked
    reply = httpx.post(f"{router.base_url}/v1/completions", json={"prompt": "hi"},
                       headers={"Origin": "https://app.example"}, timeout=30)
    assert (reply.status_code, reply.headers["access-control-allow-origin"]) == (200, "*")
    narrowed = run_router(ScriptedWorkers({A: ok("a"), B: ok("b")}),
                          cors=CorsSettings(allowed_origins=("https://app.example",)))
    other = httpx.options(f"{narrowed.base_url}/v1/completions",
                          headers={**preflight, "Origin": "https://evil.example"}, timeout=30)
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
