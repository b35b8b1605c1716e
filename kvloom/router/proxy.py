"""Forwarding one request to a worker, with the retry rule.

A request is retried on another worker only when it cannot have started on the one it
was sent to: the connection failed, or closed before any response header, or the
worker answered 503 ``model_not_ready`` (loading or shutting down). A refused
connection or a ``model_not_ready`` marks the worker down at once; a connection closed
early (which a worker's keep-alive timeout can also cause) lets the request try that
worker once more on a fresh connection, and asks for a health check. Once the response
has started, it is the client's: status codes and error bodies pass through, and a
stream that breaks ends with an SSE error event naming the worker, then ``[DONE]``; a
non-streamed body that breaks is a 502.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import httpx
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvloom.router.metrics import RouterMetrics
from kvloom.router.policy import Decision, WorkerLoad
from kvloom.router.workers import WorkerPool
from kvloom.server.errors import SERVER_ERROR, APIError, overloaded

logger = logging.getLogger(__name__)

WORKER_HEADER = "x-kvloom-worker"  # on every proxied response: which worker answered
# Request headers not forwarded: hop-by-hop ones, and those httpx sets for the new request.
_DROP_REQUEST_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                                   "te", "upgrade", "proxy-authorization", "proxy-connection",
                                   "accept-encoding"})
_PASS_RESPONSE_HEADERS = frozenset({"content-type", "retry-after", "www-authenticate", "cache-control",
                                    "x-accel-buffering"})
# A worker is tried at most this often for one request (once more after an early close).
_ATTEMPTS_PER_WORKER = 2
SSE_DONE = b"data: [DONE]\n\n"

Chooser = Callable[[Sequence[WorkerLoad]], Decision]


@dataclass(frozen=True)
class Forward:
    """One request to forward: ``choose`` picks among the up workers not yet given up on
    (only those ``among``, when given: one pool of a disaggregated router)."""

    method: str
    path: str
    body: bytes
    headers: Mapping[str, str]
    stream: bool
    choose: Chooser
    among: Collection[str] | None = None


class Proxy:
    def __init__(self, pool: WorkerPool, client: httpx.AsyncClient, metrics: RouterMetrics) -> None:
        self.pool = pool
        self.client = client
        self.metrics = metrics

    async def forward(self, request: Forward) -> Response:
        """The worker's response; APIError 503 ``no_worker_available`` when no worker (of
        ``request.among``) is up, or all failed before answering."""
        tried: dict[str, int] = {}
        response = await self.try_forward(request, tried)
        if response is None:
            self.metrics.unroutable.inc()
            raise overloaded("no worker is up to take this request" + (
                f" (tried {', '.join(tried)})" if tried else ""), code="no_worker_available")
        return response

    async def try_forward(self, request: Forward, tried: dict[str, int] | None = None) -> Response | None:
        """As ``forward``, but None where that raises; ``tried`` collects the workers tried."""
        tried = {} if tried is None else tried
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST_HEADERS}
        while True:
            candidates = self.pool.loads(tried, _ATTEMPTS_PER_WORKER, request.among)
            if not candidates:
                return None
            decision = request.choose(candidates)
            url = decision.worker
            tried[url] = tried.get(url, 0) + 1
            self.metrics.requests.labels(url, decision.reason).inc()
            self.pool.acquire(url)
            upstream = self.client.build_request(request.method, f"{url}{request.path}", content=request.body,
                                                 headers=headers)
            try:
                response = await self.client.send(upstream, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as error:
                self._retry(url, "connect", error)
                tried[url] = _ATTEMPTS_PER_WORKER
                self.pool.mark_down(url, f"connection failed ({error!r})")
                continue
            except (httpx.RemoteProtocolError, httpx.NetworkError, httpx.WriteTimeout) as error:
                self._retry(url, "disconnect", error)
                self.pool.probe_soon(url)
                continue
            except BaseException:
                self.pool.release(url)
                raise
            if response.status_code == 503 and await _not_ready(response):
                await response.aclose()
                self._retry(url, "not_ready", None)
                tried[url] = _ATTEMPTS_PER_WORKER
                self.pool.mark_down(url, "answered 503 model_not_ready")
                continue
            if request.stream and response.status_code == 200:
                return ProxiedStream(self, url, response)
            return await self._whole(url, response)

    def _retry(self, url: str, reason: str, error: BaseException | None) -> None:
        self.pool.release(url)
        self.metrics.retries.labels(url, reason).inc()
        logger.info("retrying a request elsewhere: worker %s failed before answering (%s: %r)", url, reason, error)

    async def _whole(self, url: str, response: httpx.Response) -> Response:
        """A non-streamed response, read whole, passed through with its status."""
        try:
            content = await response.aread()
        except httpx.HTTPError as error:
            self.metrics.stream_errors.labels(url).inc()
            self.pool.probe_soon(url)
            return worker_failed(url, error).response()
        finally:
            self.pool.release(url)  # first: an await below may be cancelled (the client left)
            await response.aclose()
        return Response(content, status_code=response.status_code, headers=_response_headers(response, url))


class ProxiedStream(StreamingResponse):
    """A worker's SSE stream, passed on event by event. Whatever ends it (the worker's
    last event, a break, the client leaving), the upstream response is closed, which
    aborts the request on the worker, and the worker's in-flight count is released."""

    def __init__(self, proxy: Proxy, url: str, upstream: httpx.Response) -> None:
        self.proxy, self.url, self.upstream = proxy, url, upstream
        self._released = False
        super().__init__(self._events(), status_code=upstream.status_code,
                         headers=_response_headers(upstream, url))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()  # also when the client left before the first event

    async def _close(self) -> None:
        if not self._released:
            self._released = True
            self.proxy.pool.release(self.url)  # first: the await below may be cancelled
            await self.upstream.aclose()

    async def _events(self) -> AsyncIterator[bytes]:
        # Whole events only: after a break the client must not get half an event.
        pending = b""
        try:
            async for chunk in self.upstream.aiter_bytes():
                pending += chunk
                end = pending.rfind(b"\n\n")
                if end >= 0:
                    yield pending[:end + 2]
                    pending = pending[end + 2:]
        except httpx.HTTPError as error:
            self.proxy.metrics.stream_errors.labels(self.url).inc()
            self.proxy.pool.probe_soon(self.url)
            body = worker_failed(self.url, error).body()
            yield f"data: {json.dumps(body)}\n\n".encode() + SSE_DONE
            return
        if pending:
            yield pending


def worker_failed(url: str, error: BaseException) -> APIError:
    return APIError(502, f"worker {url} failed while answering this request ({type(error).__name__}: "
                    f"{error}); it had started there, so it was not retried", SERVER_ERROR, None, "worker_failed")


async def _not_ready(response: httpx.Response) -> bool:
    """A 503 ``model_not_ready`` (the request never reached the engine); reads the body."""
    try:
        body = json.loads(await response.aread())
        return bool(body["error"]["code"] == "model_not_ready")
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return False


def _response_headers(response: httpx.Response, url: str) -> dict[str, str]:
    headers = {k: v for k, v in response.headers.items() if k.lower() in _PASS_RESPONSE_HEADERS}
    headers[WORKER_HEADER] = url
    return headers

