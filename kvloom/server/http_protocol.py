"""The HTTP/1.1 connection guards a public server needs, on top of uvicorn's h11 protocol.

uvicorn (with h11) waits forever for a request's headers, so a client that trickles
header bytes (slowloris) holds a socket and a task for as long as it likes, and an
over-long header block gets a plain-text 400. Here:

- **Header deadline**: a connection must send complete request headers within
  ``header_timeout`` seconds of connecting, or of the end of its previous response;
  otherwise it is closed. Trickling bytes does not extend the deadline.
- **Body deadline**: once its headers are in, a request must send its whole body
  within ``body_timeout`` seconds, or the connection is closed (the request is then a
  client disconnect). uvicorn waits forever for a body that stops short of its
  ``Content-Length``, which is the same attack one step later.
- **431** (Request Header Fields Too Large), in OpenAI's error shape, for a header
  block over ``max_header_bytes``.
- **Bounded connections**: beyond ``max_connections`` open connections uvicorn
  answers 503 to new requests (its ``limit_concurrency``); idle keep-alive
  connections close after ``keep_alive_timeout`` seconds.

``uvicorn_config`` builds the server configuration with all of these.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import Iterator
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvloom.server.errors import error_body
from kvloom.server.settings import ConnectionLimits

__all__ = ["ConnectionLimits", "GuardedH11Protocol", "uvicorn_config"]


class _Connection(h11.Connection):
    """h11's connection, remembering the status its last protocol error suggests
    (431 for an over-long header block, 400 otherwise)."""

    error_status = 400

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as error:
            self.error_status = error.error_status_hint
            raise


def _headers_too_large_body(limit: int) -> bytes:
    message = f"request headers exceed {limit} bytes"
    return json.dumps(error_body(message, code="request_header_fields_too_large")).encode()


class _HeaderSizeLimit:
    """ASGI wrapper: 431 for a request whose header block, parsed whole, is over the
    limit (h11 only measures a block that arrives in pieces)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and sum(len(k) + len(v) + 4 for k, v in scope["headers"]) > self.max_bytes:
            body = _headers_too_large_body(self.max_bytes)
            await send({"type": "http.response.start", "status": 431,
                        "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header deadline and the 431 answer (see above)."""

    limits = ConnectionLimits()  # replaced per server by uvicorn_config's subclass

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Connection(h11.SERVER, self.limits.max_header_bytes)
        self.app = _HeaderSizeLimit(self.app, self.limits.max_header_bytes)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._body_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        self._disarm_body_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
            self._disarm_header_deadline()
        if self.conn.their_state is h11.SEND_BODY:  # a body is due, from the first time seen
            if self._body_deadline is None:
                self._body_deadline = self.loop.call_later(self.limits.body_timeout, self._body_too_late)
        else:
            self._disarm_body_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_deadline()  # the next request's headers are due in time too

    def send_400_response(self, msg: str) -> None:
        if self.conn.error_status != 431:
            super().send_400_response(msg)
            return
        body = _headers_too_large_body(self.limits.max_header_bytes)
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (h11.Response(status_code=431, headers=headers, reason=b"Request Header Fields Too Large"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.limits.header_timeout, self._headers_too_late)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _disarm_body_deadline(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _body_too_late(self) -> None:
        self._body_deadline = None
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.transport.close()

    def _headers_too_late(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def uvicorn_config(app: Any, limits: ConnectionLimits | None = None, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's configuration for ``app`` with the connection guards of ``limits``."""
    limits = limits or ConnectionLimits()
    protocol = type("KvloomH11Protocol", (GuardedH11Protocol,), {"limits": limits})
    return uvicorn.Config(app, http=protocol, limit_concurrency=limits.max_connections,
                          timeout_keep_alive=limits.keep_alive_timeout,
                          h11_max_incomplete_event_size=limits.max_header_bytes, **kwargs)


@contextlib.contextmanager
def signals_end_quietly() -> Iterator[None]:
    """uvicorn re-raises the signal it shut down on, with the handler found at start.
    A no-op handler there turns "killed by SIGTERM" / KeyboardInterrupt into exit 0,
    and lets the caller's cleanup run (the server's engine, the router's workers)."""
    signals = (signal.SIGINT, signal.SIGTERM)
    try:
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in signals}
    except ValueError:  # not the main thread: uvicorn does not capture signals either
        yield
        return
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
