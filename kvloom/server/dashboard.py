"""The live dashboard at ``/dashboard`` (off with ``--disable-dashboard``).

The page (static/dashboard.html, dashboard.js, with uPlot vendored under
static/vendor: the machines reach no CDN) draws what ``LiveStats`` collects on the
engine thread (server/live_stats.py): throughput, requests running / waiting /
preempted, KV blocks in use and cached, the prefix-cache hit rate, TTFT and ITL
percentiles, and the scheduler's timeline, a row per recent request and a column per
step. Its data:

- ``GET /dashboard/data?since=V``: what changed after version V, as JSON (V=0: all);
- ``GET /dashboard/events?since=V&interval=S``: the same as server-sent events, one
  message every S seconds (default 0.2, at least 0.1) while the client listens;
- ``GET /dashboard/requests/{id}``: one request's row (404 once it is no longer kept).

The paths follow the API-key rule of ``/metrics`` (server/middleware.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from kvloom.config import EngineConfig
from kvloom.server.async_engine import AsyncEngine
from kvloom.server.errors import APIError
from kvloom.server.live_stats import LiveStats

STATIC = Path(__file__).parent / "static"
# The scheduler trace the timeline reads, when --trace did not ask for one: LiveStats
# takes each step's record right after the step, so a short ring is enough (each
# record lists the step's waiting requests: a long one would hold a lot).
TRACE_CAPACITY = 256
MIN_INTERVAL = 0.1


def with_trace(config: EngineConfig) -> EngineConfig:
    """``config`` with the scheduler's trace on (a short ring), as the timeline needs."""
    if config.scheduler.trace:
        return config
    scheduler = dataclasses.replace(config.scheduler, trace=True, trace_capacity=TRACE_CAPACITY)
    return dataclasses.replace(config, scheduler=scheduler)


def install(app: FastAPI, async_engine: AsyncEngine) -> LiveStats:
    """Add the dashboard's routes to ``app`` and its collector to the engine's observers."""
    live = LiveStats()
    async_engine.observers.append(live)
    app.state.live_stats = live
    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")

    @app.get("/dashboard", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "dashboard.html", media_type="text/html")

    @app.get("/dashboard/data")
    async def data(since: int = 0) -> dict[str, Any]:
        return live.snapshot(since)

    @app.get("/dashboard/requests/{request_id}")
    async def request_row(request_id: str) -> JSONResponse:
        row = live.request(request_id)
        if row is None:
            raise APIError(404, f"request {request_id!r} is not among the dashboard's recent requests",
                           code="request_not_found", param="request_id")
        return JSONResponse(row)

    @app.get("/dashboard/events")
    async def events(request: Request, since: int = 0, interval: float = 0.2) -> StreamingResponse:
        period = max(MIN_INTERVAL, interval)

        async def stream() -> AsyncIterator[str]:
            version = since
            while not await request.is_disconnected():
                snapshot = live.snapshot(version)
                version = snapshot["version"]
                yield f"data: {json.dumps(snapshot, separators=(',', ':'))}\n\n"
                await asyncio.sleep(period)  # the refresh period, not a synchronisation

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return live
