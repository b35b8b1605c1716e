"""The router's FastAPI app: an OpenAI-compatible front over the workers.

Generation requests (completions, chat, responses) go to the worker the policy picks
from the request's routing key (``routing_key``), and requests about a stored response
(one by id, or one that continues from it) to the worker that stored it
(kvloom/router/stored_responses.py); ``/tokenize``, ``/detokenize`` and ``/v1/models`` go to the least
loaded worker. The router validates nothing a worker validates: a bad body is passed
to a worker, whose 400 comes back as is. ``/health``, ``/metrics`` and ``/version``
are the router's own. A disaggregated router (``--prefill``/``--decode``) sends each
generation request through a prefill and a decode instance (kvloom/router/disagg.py),
and the other requests to the least loaded decode instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvloom import __version__
from kvloom.router.config import RouterConfig
from kvloom.router.disagg import Disaggregation
from kvloom.router.metrics import DisaggMetrics, RouterMetrics, sum_metrics
from kvloom.router.policy import Decision, RoutingPolicy, WorkerLoad, make_policy
from kvloom.router.proxy import Forward, Proxy
from kvloom.router.stored_responses import StoredResponses, to_owner
from kvloom.router.workers import WorkerPool
from kvloom.server.errors import install_error_handlers, overloaded
from kvloom.server.middleware import BodySizeLimitMiddleware, install_cors

# Below the workers' keep-alive timeout (5 s by default), so that the router does not
# send a request on a connection the worker is closing.
KEEPALIVE_EXPIRY = 2.0


@dataclass
class Router:
    """What the routes share; one per app."""

    config: RouterConfig
    policy: RoutingPolicy
    metrics: RouterMetrics
    client: httpx.AsyncClient
    pool: WorkerPool
    proxy: Proxy
    stored: StoredResponses  # where a stored response lives (the Responses API's store)
    disagg: Disaggregation | None = None  # with prefill and decode pools
    # The workers that answer /tokenize, /detokenize, /v1/models: all, or the decode pool.
    any_worker: frozenset[str] | None = None


def build_router(config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None) -> Router:
    """The router's state; ``transport`` replaces the network (tests)."""
    policy = make_policy(config.policy, config.policy_config)
    metrics = RouterMetrics()
    client = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(None, connect=config.connect_timeout),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                                   keepalive_expiry=KEEPALIVE_EXPIRY))
    pool = WorkerPool(config, client, metrics, on_down=policy.forget_worker)
    proxy = Proxy(pool, client, metrics)
    stored = StoredResponses(pool, client, config.worker_headers, config.health_timeout)
    if not config.disaggregated:
        return Router(config, policy, metrics, client, pool, proxy, stored)
    disagg = Disaggregation(config, proxy, policy, DisaggMetrics(metrics.registry), stored)
    return Router(config, policy, metrics, client, pool, proxy, stored, disagg, frozenset(config.decode))


def build_router_app(config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The router's app. Its lifespan runs the health checks and closes the client."""
    router = build_router(config, transport)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        health = asyncio.create_task(router.pool.health_loop())
        try:
            yield
        finally:
            health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await health
            await router.client.aclose()

    app = FastAPI(title="kvloom router", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_body_bytes)
    install_cors(app, config.cors)  # last: outermost (preflights answered here, not forwarded)
    app.state.router = router

    async def generate(request: Request) -> Response:
        body = await request.body()
        parsed = _json_object(body)
        key = routing_key(request.url.path, parsed or {})
        if router.disagg is not None:
            return await until_disconnect(request, router.disagg.generate(
                request.url.path, body, parsed, request.headers, key))
        previous = (parsed or {}).get("previous_response_id") if request.url.path == "/v1/responses" else None
        owner = await router.stored.owner(previous) if isinstance(previous, str) else None
        return await until_disconnect(request, router.proxy.forward(Forward(
            "POST", request.url.path, body, request.headers, (parsed or {}).get("stream") is True,
            to_owner(owner, lambda candidates: router.policy.route(key, candidates)))))

    async def stored_response(request: Request) -> Response:
        """GET (with ``stream=true``: its events again, passed on as they come), DELETE and
        cancel of a stored response: to the worker that holds it
        (kvloom/router/stored_responses.py); when none does, any worker's 404 names it."""
        body = await request.body()
        owner = await router.stored.owner(request.path_params["response_id"], router.any_worker)
        path = f"{request.url.path}?{request.url.query}" if request.url.query else request.url.path
        stream = request.query_params.get("stream", "").lower() in ("1", "true", "yes", "on")  # FastAPI's true
        return await until_disconnect(request, router.proxy.forward(Forward(
            request.method, path, body, request.headers, stream, to_owner(owner, least_loaded), router.any_worker)))

    async def any_worker(request: Request) -> Response:
        body = await request.body()
        return await router.proxy.forward(Forward(request.method, request.url.path, body, request.headers,
                                                  False, least_loaded, router.any_worker))

    app.add_api_route("/v1/completions", generate, methods=["POST"])
    app.add_api_route("/v1/chat/completions", generate, methods=["POST"])
    app.add_api_route("/v1/responses", generate, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"])
    app.add_api_route("/v1/responses/{response_id}/cancel", stored_response, methods=["POST"])
    app.add_api_route("/v1/messages", generate, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", any_worker, methods=["POST"])

    async def embeddings(request: Request) -> Response:
        """Cache-aware like a completion; a disaggregated router sends it to a decode
        instance (it has no decode to hand over: one step computes it)."""
        if router.disagg is not None:
            return await any_worker(request)
        return await generate(request)

    app.add_api_route("/v1/embeddings", embeddings, methods=["POST"])
    # Pooling routes alike: a classification, scores (embeddings paired, or a cross-encoder's pairs),
    # and SageMaker's one route for every task (keyed by whichever prompt field its body has).
    for path in ("/classify", "/v1/classify", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank",
                 "/v2/rerank", "/invocations"):
        app.add_api_route(path, embeddings, methods=["POST"])
    app.add_api_route("/tokenize", any_worker, methods=["POST"])
    app.add_api_route("/detokenize", any_worker, methods=["POST"])
    app.add_api_route("/v1/models", any_worker, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", any_worker, methods=["GET"])

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while at least one worker is up (disaggregated: a decode instance, which
        can serve alone); 503 otherwise. Lists every worker's state (disaggregated: also
        by pool, ``prefill`` and ``decode``)."""
        workers = {w.url: "up" if w.up else "down" for w in router.pool.workers.values()}
        pools: dict[str, Any] = {"workers": workers}
        if config.disaggregated:
            pools["prefill"] = {url: workers[url] for url in config.prefill}
            pools["decode"] = {url: workers[url] for url in config.decode}
        if not router.pool.loads(among=router.any_worker):
            what = "decode instance" if config.disaggregated else "worker"
            error = overloaded(f"no {what} is up", code="no_worker_available")
            return JSONResponse({**error.body(), **pools}, status_code=503)
        return JSONResponse({"status": "ok", **pools})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        """vLLM's, on every worker that is up: ``reset`` where each one's is (a worker that
        does not answer counts as not reset); ``workers``: each one's answer."""
        urls = [w.url for w in router.pool.up()]
        answers = await asyncio.gather(*(_worker_reset(router, url) for url in urls))
        return JSONResponse({"reset": bool(urls) and all(answers), "workers": dict(zip(urls, answers, strict=True))})

    @app.get("/metrics")
    async def metrics() -> Response:
        texts = await asyncio.gather(*(_worker_metrics(router, w.url) for w in router.pool.up()))
        text = sum_metrics(t for t in texts if t is not None) + router.metrics.render()
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return app


async def until_disconnect(request: Request, forward: Coroutine[Any, Any, Response]) -> Response:
    """``forward``'s response, unless the client leaves first: then it is cancelled, which
    closes the connection to the worker, and the worker aborts the request (as it does
    for its own clients). A stream, once returned, watches for that itself."""
    task = asyncio.ensure_future(forward)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            return Response(status_code=499)  # nobody reads it: the client is gone
        raise
    finally:
        watcher.cancel()


def least_loaded(candidates: Sequence[WorkerLoad]) -> Decision:
    """For requests that use no cache: the least loaded worker (the first of ties)."""
    return Decision(min(candidates, key=lambda c: c.in_flight).worker, "least_loaded")


async def _worker_metrics(router: Router, url: str) -> str | None:
    try:
        response = await router.client.get(f"{url}/metrics", timeout=router.config.health_timeout)
    except httpx.HTTPError:
        return None  # left out of the sums; the health check decides whether it is down
    return response.text if response.status_code == 200 else None


async def _worker_reset(router: Router, url: str) -> bool:
    try:
        response = await router.client.post(f"{url}/reset_prefix_cache", headers=router.config.worker_headers,
                                            timeout=router.config.health_timeout)
        return response.status_code == 200 and response.json().get("reset") is True
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


def _json_object(body: bytes) -> dict[str, Any] | None:
    """``body`` as a JSON object; None when it is not one."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def routing_key(path: str, body: dict[str, Any]) -> str:
    """The text whose prefix decides where a request goes: a completion's prompt (the
    first of a batch; token ids as one character each), or a chat's message contents,
    in order, each ended by a newline (a Responses request's instructions, then its
    input's messages, as the chat it amounts to; an Anthropic Messages request's system
    prompt, then its messages). A body the router cannot read has the key "".
    A ``cache_salt`` goes first, between NULs: the workers' caches serve a salt only
    its own prefixes, so the router keeps each salt's prefixes apart as well. So does
    the ``model`` named, before it: a LoRA adapter's KV is its own (and the base model
    named in two ways splits its prefixes, the price of not asking workers which is which)."""
    salt, model = body.get("cache_salt"), body.get("model")
    text = _prompt_text(path, body)
    if isinstance(salt, str) and salt and text:
        text = f"\0{salt}\0{text}"
    return f"\1{model}\1{text}" if isinstance(model, str) and model and text else text


def _prompt_text(path: str, body: dict[str, Any]) -> str:
    if path == "/invocations":  # the route its fields name (server/serving_invocations.py)
        path = ("/chat/completions" if "messages" in body else "/embeddings" if "input" in body
                else "/completions")
    if path.endswith("/responses"):
        instructions, items = body.get("instructions"), body.get("input")
        head = f"{instructions}\n" if isinstance(instructions, str) else ""
        if isinstance(items, str):
            return f"{head}{items}\n"
        if not isinstance(items, list):
            return ""
        return head + "".join(f"{_content_text(item.get('content'))}\n" for item in items
                              if isinstance(item, dict) and "role" in item)
    if path.endswith("/messages"):  # Anthropic's: the system prompt first, then the messages
        system, messages = body.get("system"), body.get("messages")
        head = f"{_content_text(system)}\n" if system is not None else ""
        if not isinstance(messages, list):
            return ""
        return head + "".join(f"{_content_text(m.get('content'))}\n" for m in messages if isinstance(m, dict))
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        return "".join(f"{_content_text(m.get('content'))}\n" for m in messages if isinstance(m, dict))
    prompt = body.get("input" if path.endswith(("/embeddings", "/classify", "/pooling")) else "prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        # A token id as one code point (mod the code space): same ids, same key.
        return "".join(chr(t % 0x110000) for t in prompt)
    return ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones
        return "".join(str(p.get("text", "")) for p in content
                       if isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text"))
    return ""
