"""A kvloom server in a background thread of this process, on a free loopback port.

For tools that drive a server and then inspect its engine (``kvloom bench soak``, the
test suite): ``snapshot()`` runs ``check_integrity()`` on the engine thread and
reports the pool. The port is bound before uvicorn starts (no race for it).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import uvicorn

from kvloom.engine.engine import LLMEngine
from kvloom.server.app import build_app
from kvloom.server.async_engine import AsyncEngine, EngineSnapshot
from kvloom.server.http_protocol import uvicorn_config
from kvloom.server.settings import ConnectionLimits, ServerSettings


@dataclass
class BackgroundServer:
    base_url: str
    async_engine: AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread
    settings: ServerSettings

    def snapshot(self) -> EngineSnapshot:
        return self.async_engine.snapshot_from_thread()

    def wait_until(self, predicate: Callable[[EngineSnapshot], bool], timeout: float = 10.0) -> EngineSnapshot:
        """Poll the engine state until ``predicate`` holds (AssertionError after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            snapshot = self.snapshot()
            if predicate(snapshot):
                return snapshot
            if time.monotonic() > deadline:
                raise AssertionError(f"engine state never satisfied the condition: {snapshot}")
            time.sleep(0.02)

    def wait_until_idle(self, timeout: float = 10.0) -> EngineSnapshot:
        """The engine's state once nothing runs, waits or streams (blocks still held
        then are leaked)."""
        return self.wait_until(lambda s: s.num_running == 0 and s.num_waiting == 0
                               and s.num_active_requests == 0, timeout)

    def assert_idle_and_clean(self, timeout: float = 10.0) -> None:
        """No request left behind: nothing running or waiting, every block reclaimable."""
        snapshot = self.wait_until_idle(timeout)
        assert snapshot.num_available_blocks == snapshot.num_blocks, snapshot

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        if self.thread.is_alive():
            raise RuntimeError("server thread did not stop")


def start_background_server(make_engine: Callable[[], LLMEngine], settings: ServerSettings,
                            max_waiting: int = 1024, limits: ConnectionLimits | None = None,
                            startup_deadline: float = 120.0,
                            stats_log_interval: float | None = None) -> BackgroundServer:
    """Start the app on 127.0.0.1 (a free port) and return once ``/health`` is 200."""
    async_engine = AsyncEngine(make_engine, max_waiting=max_waiting,
                               stats_log_interval=stats_log_interval)
    app = build_app(async_engine, settings)
    # IPPROTO_TCP is explicit because asyncio sets TCP_NODELAY only on sockets that say
    # so; without it, Nagle + delayed ACK add ~40 ms to every response.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, limits, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    background = BackgroundServer(f"http://127.0.0.1:{port}", async_engine, server, thread, settings)
    try:
        wait_for_health(background.base_url, startup_deadline, lambda: async_engine.load_error)
    except BaseException:
        background.stop()
        raise
    return background


def wait_for_health(base_url: str, deadline_s: float,
                    load_error: Callable[[], BaseException | None] = lambda: None) -> None:
    """Until ``/health`` is 200; a model that failed to load ends the wait at once with
    its error (``/health`` would answer 503 until the deadline)."""
    deadline = time.monotonic() + deadline_s
    last: object = None
    while time.monotonic() < deadline:
        error = load_error()
        if error is not None:
            raise RuntimeError(f"the model failed to load: {error}") from error
        try:
            response = httpx.get(f"{base_url}/health", timeout=2.0)
            if response.status_code == 200:
                return
            last = response.status_code
        except httpx.TransportError as error:  # not listening yet
            last = error
        time.sleep(0.05)
    raise AssertionError(f"server at {base_url} never became healthy (last: {last!r})")
