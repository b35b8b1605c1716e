"""``run_router``: check the workers, bind the port, serve until a signal.

The order is the startup contract: the listening port is bound first (a port in use is
an error naming it, before any waiting), then every worker must answer ``/v1/models``
within ``startup_timeout`` and agree on the model, block size and context (else an
error naming both workers), and only then does the router serve. Nothing waits without
a deadline. A disaggregated router also checks every instance's role and KV layout
(``GET /kvloom/kv_transfer``) before it serves.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn

from kvloom.router.app import build_router_app
from kvloom.router.config import RouterConfig
from kvloom.router.workers import RouterStartupError, WorkerInfo, check_workers
from kvloom.server.http_protocol import ConnectionLimits, signals_end_quietly, uvicorn_config

logger = logging.getLogger(__name__)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on ``host:port``; RouterStartupError naming the port
    when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise RouterStartupError(f"port {port} on {host} is already in use; choose another "
                                     "with --port") from None
        raise RouterStartupError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def run_router(config: RouterConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
               limits: ConnectionLimits | None = None, sock: socket.socket | None = None) -> int:
    """Serve until SIGINT/SIGTERM; 0 then. RouterStartupError (a ValueError) when the
    port is taken, a worker does not answer in time, or the workers disagree."""
    sock = sock or bind_socket(host, port)
    try:
        infos = asyncio.run(check_workers(config))
    except BaseException:
        sock.close()
        raise
    _log_workers(infos)
    app = build_router_app(config)
    server = uvicorn.Server(uvicorn_config(app, limits, log_level=log_level, timeout_graceful_shutdown=5))
    logger.info("kvloom router on http://%s:%d, policy %s%s", host, sock.getsockname()[1], config.policy,
                f", {len(config.prefill)} prefill and {len(config.decode)} decode instances"
                if config.disaggregated else "")
    with signals_end_quietly():
        server.run(sockets=[sock])
    return 0


def configure_logging(level: str) -> None:
    """uvicorn configures its own loggers only; give ours a handler unless the host did."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: health checks would flood the log.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def _log_workers(infos: dict[str, WorkerInfo]) -> None:
    for url, info in infos.items():
        logger.info("%s %s: %s (context %s, block size %s)", info.role or "worker", url, info.model,
                    info.max_model_len, info.block_size)


@dataclass
class BackgroundRouter:
    """A router in a thread of this process on a free loopback port (tests, tools)."""

    base_url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        if self.thread.is_alive():
            raise RuntimeError("router thread did not stop")


def start_background_router(config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None,
                            check: bool = True, deadline_s: float = 30.0) -> BackgroundRouter:
    """Start the router on 127.0.0.1 (a free port); return once its ``/version`` answers.
    ``check``: run the startup check first, as ``run_router`` does."""
    if check:
        asyncio.run(check_workers(config, transport))
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    app = build_router_app(config, transport)
    server = uvicorn.Server(uvicorn_config(app, None, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    stop_at = time.monotonic() + deadline_s
    while not server.started:
        if time.monotonic() > stop_at or not thread.is_alive():
            raise RuntimeError(f"router at {base_url} did not start")
        time.sleep(0.01)
    return BackgroundRouter(base_url, server, thread)
