"""``run_server``: build the engine, the app and a uvicorn server, and run until a signal.

Shutdown order on SIGINT/SIGTERM: uvicorn stops accepting connections; our signal hook
tells the engine thread to abort every in-flight request (streams end, waiting
handlers answer 503), so open connections drain at once instead of running their
generations to the end; then the app's lifespan joins the engine thread. Exit status 0.
"""

from __future__ import annotations

import logging
from typing import Any

import uvicorn

from kvloom.server import dashboard
from kvloom.server.async_engine import AsyncEngine
from kvloom.server.http_protocol import ConnectionLimits, signals_end_quietly, uvicorn_config
from kvloom.server.settings import (
    DEFAULT_MAX_WAITING,
    STATS_LOG_INTERVAL,
    ServerSettings,
)

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn's server, plus: a shutdown signal also aborts the engine's requests."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine) -> None:
        super().__init__(config)
        self.async_engine = async_engine

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        self.async_engine.request_shutdown()


def run_server(model: str, engine_kwargs: dict[str, Any] | None = None, settings: ServerSettings | None = None,
               host: str = "127.0.0.1", port: int = 8000, max_waiting: int = DEFAULT_MAX_WAITING,
               log_stats: bool = True, log_level: str = "info", graceful_timeout: float = 10.0,
               limits: ConnectionLimits | None = None, http_options: dict[str, Any] | None = None) -> int:
    """Serve ``model`` over HTTP until SIGINT/SIGTERM. Returns the exit status: 0 after
    a signal, 1 when the model failed to load or the engine failed while serving (so a
    supervisor restarts it). Bad engine flags raise ValueError first. ``settings``: the
    HTTP layer's (served names, API key, parsers, CORS, ...; ``ServerSettings()``
    without). ``log_stats``: a stats line every ``STATS_LOG_INTERVAL`` seconds while
    busy (server/stats_log.py). ``http_options``: uvicorn's own (TLS files,
    ``root_path``, ``access_log``, its ``log_level``), as ``kvloom serve``'s HTTP flags
    give them."""
    from kvloom.config import EngineConfig
    from kvloom.engine.engine import LLMEngine
    from kvloom.server.app import build_app

    config = EngineConfig.from_kwargs(model, **(engine_kwargs or {}))  # validate flags up front
    if max_waiting < 0:
        raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
    settings = settings or ServerSettings()
    if (settings.lora_modules or settings.allow_runtime_lora_updating) and not config.lora.enable_lora:
        raise ValueError("lora_modules (--lora-modules) and allow_runtime_lora_updating need enable_lora "
                         "(--enable-lora)")
    if settings.enable_dashboard:
        config = dashboard.with_trace(config)  # its timeline reads the scheduler's trace
    async_engine = AsyncEngine(lambda: LLMEngine(config), max_waiting=max_waiting,
                               stats_log_interval=STATS_LOG_INTERVAL if log_stats else None)
    app = build_app(async_engine, settings)
    _configure_logging(log_level)
    options = {"log_level": log_level, **(http_options or {})}
    server = _Server(uvicorn_config(app, limits, host=host, port=port, timeout_graceful_shutdown=graceful_timeout,
                                    **options), async_engine)
    load_errors: list[BaseException] = []

    def on_load_failed(error: BaseException) -> None:  # called on the engine thread
        load_errors.append(error)
        server.should_exit = True

    def on_engine_failed(error: BaseException) -> None:  # engine thread, after failing every request
        engine_errors.append(error)
        server.should_exit = True

    engine_errors: list[BaseException] = []
    async_engine.on_load_failed = on_load_failed
    async_engine.on_engine_failed = on_engine_failed
    scheme = "https" if options.get("ssl_certfile") else "http"
    logger.info("kvloom serving %s on %s://%s:%d%s (loading the model...)", model, scheme, host, port,
                options.get("root_path") or "")
    with signals_end_quietly():
        server.run()
    if engine_errors:
        logger.error("exiting with status 1 after an engine fault: %s", engine_errors[0])
    return 1 if load_errors or engine_errors else 0


def _configure_logging(level: str) -> None:
    # uvicorn configures its own loggers only; give ours a handler unless the host app did.
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
