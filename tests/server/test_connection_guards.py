"""Connection guards (server/http_protocol.py): slow-header connections are closed at
the header deadline, an over-long header block is a 431 in OpenAI's error shape, and
normal keep-alive traffic is untouched."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from server_harness import SERVED_NAME, LiveServer, start_live_server

from kvloom.server.http_protocol import ConnectionLimits
from kvloom.server.settings import ServerSettings

LIMITS = ConnectionLimits(header_timeout=1.0, body_timeout=1.0, max_header_bytes=8192, max_connections=64)


@pytest.fixture(scope="module")
def guarded(tiny_llama) -> Iterator[LiveServer]:
    live = start_live_server(tiny_llama, ServerSettings(served_model_name=SERVED_NAME), limits=LIMITS)
    yield live
    live.stop()


def connect(live: LiveServer) -> socket.socket:
    host, port = live.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=15)
    return sock


def test_slow_header_connections_are_closed_at_the_deadline(guarded) -> None:
    sockets = [connect(guarded) for _ in range(20)]
    started = time.monotonic()
    for sock in sockets:  # a request line and one header, then nothing more
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    for sock in sockets:
        assert sock.recv(1024) == b""  # blocks until the server closes it (socket timeout 15 s)
        sock.close()
    # All closed by the 1 s deadline, long before the socket timeout would have fired.
    assert time.monotonic() - started < 14
    with httpx.Client(base_url=guarded.base_url, timeout=30) as http:
        assert http.get("/health").status_code == 200


def test_a_body_that_stops_short_is_closed_at_the_deadline(guarded) -> None:
    """Complete headers, then a body that stops short of its Content-Length: closed at the
    body deadline (trickled bytes do not extend it), and the server goes on serving."""
    sock = connect(guarded)
    started = time.monotonic()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\"")
    sock.sendall(b" ")  # a trickle
    assert sock.recv(1024) == b""  # blocks until the server closes it (socket timeout 15 s)
    sock.close()
    assert time.monotonic() - started < 14
    with httpx.Client(base_url=guarded.base_url, timeout=30) as http:
        assert http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": "Hi", "max_tokens": 2}
                         ).status_code == 200
    guarded.assert_idle_and_clean()


@pytest.mark.parametrize("complete", [True, False], ids=["whole block", "unterminated block"])
def test_oversized_headers_get_431(guarded, complete: bool) -> None:
    # A complete block is measured once parsed; an unterminated one by h11 as it grows.
    sock = connect(guarded)
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + (b"\r\n\r\n" if complete else b"")
    sock.sendall(request)  # then only read: nothing arrives after the server's answer
    response = b""
    while chunk := sock.recv(65536):
        response += chunk
    sock.close()
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431")
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"


def test_keep_alive_requests_are_untouched(guarded) -> None:
    with httpx.Client(base_url=guarded.base_url, timeout=30) as http:
        for _ in range(3):  # one connection, three requests: the deadline re-arms between them
            response = http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": "Hi", "max_tokens": 2})
            assert response.status_code == 200
    guarded.assert_idle_and_clean()


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="header_timeout must be > 0"):
        ConnectionLimits(header_timeout=0)
    with pytest.raises(ValueError, match="body_timeout must be > 0"):
        ConnectionLimits(body_timeout=-1)
