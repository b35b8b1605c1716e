"""The live-server harness: kvloom's BackgroundServer (uvicorn on a free loopback port,
in a thread) on the tiny random model (float32, a small KV pool).

Each server is module-scoped. Readiness is awaited by polling ``/health`` with a
deadline; tests reach the engine's state through ``snapshot()`` (it runs the integrity
check on the engine thread).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.server.background import BackgroundServer, start_background_server
from kvloom.server.background import wait_for_health as _wait_for_health
from kvloom.server.settings import ConnectionLimits, ServerSettings

ENGINE_KWARGS: dict[str, Any] = dict(dtype="float32", device="cpu", num_blocks=64,
                                     block_size=16, max_model_len=256)
SERVED_NAME = "tiny-llama"
STARTUP_DEADLINE_S = 60.0


LiveServer = BackgroundServer


def start_live_server(model: Path, settings: ServerSettings, max_waiting: int = 1024,
                      step_delay: float = 0.0, limits: ConnectionLimits | None = None,
                      stats_log_interval: float | None = None, **engine_kwargs: Any) -> LiveServer:
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

    return start_background_server(make_engine, settings, max_waiting, limits, STARTUP_DEADLINE_S,
                                   stats_log_interval)


def wait_for_health(base_url: str, deadline_s: float = STARTUP_DEADLINE_S) -> None:
    _wait_for_health(base_url, deadline_s)
