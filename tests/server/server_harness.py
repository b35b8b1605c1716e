"""The live-server harness: uvicorn on a free loopback port, in a thread.

Each server is module-scoped and runs the tiny random model (float32, a small KV
pool). Readiness is awaited by polling ``/health`` with a deadline; tests reach the
engine's state through ``AsyncEngine.snapshot_from_thread`` (it runs the integrity
check on the engine thread).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.server.app import build_app
from kvloom.server.async_engine import AsyncEngine, EngineSnapshot
from kvloom.server.http_protocol import ConnectionLimits, uvicorn_config
from kvloom.server.settings import ServerSettings

ENGINE_KWARGS: dict[str, Any] = dict(dtype="float32", device="cpu", num_blocks=64,
                                     block_size=16, max_model_len=256)
SERVED_NAME = "tiny-llama"
STARTUP_DEADLINE_S = 60.0


@dataclass
class LiveServer:
    base_url: str
    async_engine: AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread
    settings: ServerSettings

    def snapshot(self) -> EngineSnapshot:
        return self.async_engine.snapshot_from_thread()

    def wait_until(self, predicate: Callable[[EngineSnapshot], bool], timeout: float = 10.0
                   ) -> EngineSnapshot:
        """Poll the engine state until ``predicate`` holds (fails after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            snapshot = self.snapshot()
            if predicate(snapshot):
                return snapshot
            if time.monotonic() > deadline:
                raise AssertionError(f"engine state never satisfied the condition: {snapshot}")
            time.sleep(0.02)

    def assert_idle_and_clean(self) -> None:
        """No request left behind: nothing running or waiting, every block reclaimable."""
        snapshot = self.wait_until(lambda s: s.num_running == 0 and s.num_waiting == 0
                                   and s.num_active_requests == 0)
        assert snapshot.num_available_blocks == snapshot.num_blocks, snapshot

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "server thread did not stop"


def start_live_server(model: Path, settings: ServerSettings, max_waiting: int = 1024,
                      step_delay: float = 0.0, limits: ConnectionLimits | None = None,
                      **engine_kwargs: Any) -> LiveServer:
    """``step_delay`` (seconds) makes every engine step that long at least, like a
    bigger model: a 200-token request then reliably outlives a client's disconnect."""
    config = EngineConfig.from_kwargs(str(model), **{**ENGINE_KWARGS, **engine_kwargs})

    def make_engine() -> LLMEngine:
        engine = LLMEngine(config)
        if step_delay:
            step = engine.step

            def slow_step() -> list:
                time.sleep(step_delay)
                return step()
            engine.step = slow_step  # type: ignore[method-assign]
        return engine

    async_engine = AsyncEngine(make_engine, max_waiting=max_waiting)
    app = build_app(async_engine, settings)
    # Bind first and hand the socket to uvicorn: no race for the port. IPPROTO_TCP is
    # explicit because asyncio sets TCP_NODELAY only on sockets that say so; without
    # it, Nagle + delayed ACK add ~40 ms to every response.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, limits, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    live = LiveServer(f"http://127.0.0.1:{port}", async_engine, server, thread, settings)
    wait_for_health(live.base_url)
    return live


def wait_for_health(base_url: str, deadline_s: float = STARTUP_DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{base_url}/health", timeout=2.0)
            if response.status_code == 200:
                return
            last = response.status_code
        except httpx.TransportError as error:  # not listening yet
            last = error
        time.sleep(0.05)
    raise AssertionError(f"server at {base_url} never became healthy (last: {last!r})")
