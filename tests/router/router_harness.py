"""Live routers for the tests: kvloom workers on the tiny model (server_harness) with a
router in a thread in front of them, and the Prometheus text parsed to samples."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.router.config import RouterConfig
from kvloom.router.main import BackgroundRouter, start_background_router
from kvloom.router.policy import PolicyConfig
from kvloom.router.proxy import WORKER_HEADER
from kvloom.server.background import BackgroundServer, start_background_server
from kvloom.server.settings import ServerSettings

SYSTEM_PIRATE = "You are a pirate. Answer every question as a pirate would, briefly and loudly. "
SYSTEM_LAWYER = "You are a careful lawyer. Qualify every answer, cite nothing, and be precise. "

# As tests/server/server_harness.py's workers: float32 on CPU, a small pool.
ENGINE_KWARGS: dict[str, Any] = dict(dtype="float32", device="cpu", num_blocks=64, block_size=16,
                                     max_model_len=256)
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def start_worker(model: Path, served_name: str = "tiny", step_delay: float = 0.0,
                 enable_responses_store: bool = False, **engine_kwargs: Any) -> BackgroundServer:
    """A kvloom server on the tiny model in a thread; ``step_delay`` makes each engine
    step last at least that long, so that requests are still running when a test acts."""
    config = EngineConfig.from_kwargs(str(model), **{**ENGINE_KWARGS, **engine_kwargs})

    def make_engine() -> LLMEngine:
        engine = LLMEngine(config)
        if step_delay:
            step = engine.step

            def slow_step() -> list[Any]:
                time.sleep(step_delay)
                return step()
            engine.step = slow_step  # type: ignore[method-assign]
        return engine

    settings = ServerSettings(served_model_name=served_name, enable_responses_store=enable_responses_store)
    return start_background_server(make_engine, settings, 1024, None, 60.0)


def start_router(worker_urls: list[str], policy: str = "cache_aware", health_interval: float = 0.2,
                 **policy_kwargs: Any) -> BackgroundRouter:
    config = RouterConfig(tuple(worker_urls), policy=policy, policy_config=PolicyConfig(**policy_kwargs),
                          health_interval=health_interval, startup_timeout=30.0)
    return start_background_router(config)


def samples(text: str) -> Samples:
    """Every sample but ``*_created`` (a timestamp, not a count)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


def worker_of(response: httpx.Response) -> str:
    return response.headers[WORKER_HEADER]


def completion(client: httpx.Client, prompt: str, **fields: Any) -> httpx.Response:
    return client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0.0,
                                                **fields})


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} never held within {timeout} s")
        time.sleep(0.02)
