"""POST /start_profile and POST /stop_profile: vLLM's, served with ``--profiler-dir`` (or
vLLM's ``VLLM_TORCH_PROFILER_DIR``). Between the two the torch profiler records what the
engine computes, a span per step (kvloom/engine/profiler.py); stopping writes the Chrome
trace into the directory, off the engine's thread (a long profile takes seconds to
write, and the engine goes on serving meanwhile), and answers with its path."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI

from kvloom.engine.profiler import write_trace
from kvloom.server.errors import bad_request
from kvloom.server.generation import Serving


def install_profiling(app: FastAPI, serving: Serving, directory: str) -> None:
    @app.post("/start_profile")
    async def start_profile() -> dict[str, Any]:
        serving.model_info()
        try:
            await serving.engine.call(lambda engine: engine.start_profile())
        except ValueError as error:  # one runs already
            raise bad_request(str(error)) from None
        return {"profiling": True}

    @app.post("/stop_profile")
    async def stop_profile() -> dict[str, Any]:
        serving.model_info()
        try:
            recording = await serving.engine.call(lambda engine: engine.profiler.stop())
        except ValueError as error:  # none runs
            raise bad_request(str(error)) from None
        path = await asyncio.to_thread(write_trace, recording, directory)
        return {"profiling": False, "trace": str(path)}
