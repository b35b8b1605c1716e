"""Pure ASGI middleware that runs before a body is read: API-key check and body limit;
and CORS (Starlette's), outside both; and the count of requests in flight (``/load``).

They are ASGI (not FastAPI dependencies) so that a request without a valid key is
refused before its body is parsed (a malformed body from an unauthenticated client
gets 401, not 400), and so that an oversized body is refused from its
Content-Length, or as soon as the bytes read exceed the limit, without buffering it.
"""

from __future__ import annotations

import hmac
import uuid

from fastapi import FastAPI, HTTPException
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvloom.server.errors import APIError
from kvloom.server.settings import CorsSettings

# Liveness, version and metrics stay open so that probes and scrapers need no key; the
# dashboard (a view of the same numbers) follows the rule of /metrics.
PUBLIC_PATHS = frozenset({"/health", "/version", "/metrics", "/ping", "/dashboard", "/load"})
PUBLIC_PREFIXES = ("/dashboard/",)


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def install_cors(app: FastAPI, cors: CorsSettings) -> None:
    """Starlette's CORSMiddleware with ``cors``; added after every other middleware, so
    that it runs first: a preflight is answered before an API key is asked for, and a
    401 or 413 carries the headers a browser needs to read it."""
    app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                       allow_methods=list(cors.allowed_methods), allow_headers=list(cors.allowed_headers),
                       allow_credentials=cors.allow_credentials)


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <api_key>`` on every path but the public ones, or
    ``x-api-key: <api_key>``, the header Anthropic's clients send."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._expected_x = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_public(scope["path"]) or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given, given_x = headers.get(b"authorization", b""), headers.get(b"x-api-key")
        # compare_digest: the time taken does not reveal how much of the key matched.
        if not (hmac.compare_digest(given, self._expected)
                or (given_x is not None and hmac.compare_digest(given_x, self._expected_x))):
            reason = "missing" if not (given or given_x) else "incorrect"
            error = APIError(401, f"{reason} API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await error.response(scope["path"])(scope, receive, send)
            return
        await self.app(scope, receive, send)


# The routes whose requests run on the engine (vLLM's /load counts the same).
LOAD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                        "/v1/embeddings", "/classify", "/v1/classify", "/pooling", "/score", "/v1/score",
                        "/rerank", "/v1/rerank", "/v2/rerank", "/invocations"})


class ServerLoad:
    """Requests on the engine's routes being answered now: from their arrival until the
    last byte of the answer is sent (a stream to its end) or the client is gone."""

    def __init__(self) -> None:
        self.in_flight = 0


class ServerLoadMiddleware:
    """Counts each request of ``LOAD_PATHS`` in ``load`` while it is served."""

    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in LOAD_PATHS:
            await self.app(scope, receive, send)
            return
        self.load.in_flight += 1
        try:
            await self.app(scope, receive, send)  # returns once the answer is sent, a stream's included
        finally:
            self.load.in_flight -= 1


class BodySizeLimitMiddleware:
    """Refuses request bodies over ``max_bytes`` with 413."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"request body exceeds the limit of {self.max_bytes} bytes",
                        param=None, code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large().response(scope["path"])(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            # Chunked uploads carry no Content-Length: count while reading.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI re-raises HTTPException from body reading; our handler
                    # turns it into the OpenAI error shape.
                    raise HTTPException(413, self._too_large().message)
            return message

        await self.app(scope, limited_receive, send)


class RequestIdHeaderMiddleware:
    """vLLM's --enable-request-id-headers: every response carries ``X-Request-Id``, the
    request's own header's value where it sent one (a proxy's trace id), else a fresh id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(name, value) for name, value in message.get("headers", []) if name != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
