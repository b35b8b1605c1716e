"""Scripted prefill and decode instances for the disaggregated router's tests
(httpx.MockTransport): ``/health``, ``/v1/models``, ``/metrics`` and
``/kvloom/kv_transfer`` answer as kvloom instances do; POSTs go to per-instance handlers
and are recorded with their JSON bodies."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from kvloom.router.config import RouterConfig
from kvloom.router.main import BackgroundRouter, start_background_router

PREFILL_A, PREFILL_B = "http://prefill-a:1", "http://prefill-b:1"
DECODE_A, DECODE_B = "http://decode-a:1", "http://decode-b:1"
LAYOUT: dict[str, Any] = {"model": "tiny", "model_fingerprint": "f00d", "dtype": "bfloat16", "block_size": 16,
                          "num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "cache_layout": "paired"}
Handler = Callable[[httpx.Request], Any]


@dataclass
class Post:
    url: str  # the instance's base URL
    path: str
    body: Any  # the JSON body it got (None if it was not JSON)


def kv_params(url: str) -> dict[str, Any]:
    """What a prefill instance at ``url`` answers: opaque to the router."""
    return {"remote_engine_id": url.removeprefix("http://"), "remote_block_ids": [3, 4],
            "remote_request_id": "cmpl-prefill", "remote_endpoint": "127.0.0.1:7000"}


def prefill_ok(request: httpx.Request) -> httpx.Response:
    url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
    return httpx.Response(200, json={"id": "cmpl-prefill", "object": "text_completion",
                                     "choices": [{"index": 0, "text": "!", "finish_reason": "length"}],
                                     "kv_transfer_params": kv_params(url)})


DECODE_EVENTS = [{"id": "cmpl-d", "object": "text_completion", "choices": [{"index": 0, "text": text}]}
                 for text in ("Ahoy", " there")]


def decode_ok(request: httpx.Request) -> httpx.Response:
    """A streamed answer (two events, then [DONE]) or a whole one, as the body asks."""
    if json.loads(request.content).get("stream") is True:
        async def events() -> AsyncIterator[bytes]:
            for event in DECODE_EVENTS:
                yield f"data: {json.dumps(event)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())
    return httpx.Response(200, json={"id": "cmpl-d", "object": "text_completion",
                                     "choices": [{"index": 0, "text": "Ahoy there"}]})


class FakeInstances:
    """Instances by base URL with their pools (``roles``: what the router is told);
    ``reported_roles``: what they say they are; ``down`` ones refuse connections;
    ``kv_transfer`` overrides an instance's ``GET /kvloom/kv_transfer`` answer."""

    def __init__(self, roles: dict[str, str], handlers: dict[str, Handler] | None = None) -> None:
        self.roles = roles
        self.handlers = {url: (prefill_ok if role == "prefill" else decode_ok) for url, role in roles.items()}
        self.handlers.update(handlers or {})
        self.reported_roles = dict(roles)
        self.kv_transfer: dict[str, httpx.Response] = {}
        self.layouts = {url: dict(LAYOUT) for url in roles}
        self.down: set[str] = set()
        self.posts: list[Post] = []

    def describe(self, url: str) -> dict[str, Any]:
        return {"role": self.reported_roles[url], "instance_id": url.encode().hex()[:16], "layout": self.layouts[url],
                "transports": ["shm", "torch"], "kv_endpoint": "127.0.0.1:7000"}

    def at(self, url: str) -> list[Any]:
        """The bodies ``url`` was sent, in order."""
        return [post.body for post in self.posts if post.url == url]

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if url in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        if path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if path == "/v1/models" and request.method == "GET":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "tiny", "object": "model", "max_model_len": 256, "block_size": 16}]})
        if path == "/metrics":
            return httpx.Response(200, text="")
        if path == "/kvloom/kv_transfer":
            return self.kv_transfer.get(url) or httpx.Response(200, json=self.describe(url))
        try:
            body = json.loads(request.content)
        except ValueError:
            body = None
        self.posts.append(Post(url, path, body))
        result = self.handlers[url](request)
        return await result if asyncio.iscoroutine(result) else result


def disagg_config(instances: FakeInstances, **kwargs: Any) -> RouterConfig:
    prefill = tuple(url for url, role in instances.roles.items() if role == "prefill")
    decode = tuple(url for url, role in instances.roles.items() if role == "decode")
    return RouterConfig(prefill=prefill, decode=decode, health_interval=kwargs.pop("health_interval", 60.0),
                        **kwargs)


class DisaggRouters:
    """Disaggregated routers (startup check included) over FakeInstances, all stopped
    at the end of the ``with``: a test module's fixture yields one."""

    def __init__(self) -> None:
        self.started: list[BackgroundRouter] = []

    def __call__(self, instances: FakeInstances, **kwargs: Any) -> BackgroundRouter:
        router = start_background_router(disagg_config(instances, **kwargs), httpx.MockTransport(instances))
        self.started.append(router)
        return router

    def __enter__(self) -> DisaggRouters:
        return self

    def __exit__(self, *exc: object) -> None:
        for router in self.started:
            router.stop()
