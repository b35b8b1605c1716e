"""--profiler-dir (vLLM's VLLM_TORCH_PROFILER_DIR): POST /start_profile and /stop_profile
record the engine's steps between them into a Chrome trace in that directory, while the
server goes on answering; started twice or stopped without a start, a 400; without the
flag the routes are not there."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import httpx
from server_harness import SERVED_NAME, start_live_server

from kvloom.server.settings import ServerSettings


def test_a_profile_between_start_and_stop_is_written_to_the_directory(tiny_llama: Path, tmp_path: Path) -> None:
    live = start_live_server(tiny_llama, ServerSettings(served_model_name=SERVED_NAME,
                                                        profiler_dir=str(tmp_path / "traces")))
    try:
        with httpx.Client(base_url=live.base_url, timeout=60) as http:
            assert http.post("/start_profile").json() == {"profiling": True}
            again = http.post("/start_profile")
            assert again.status_code == 400 and "running already" in again.json()["error"]["message"]
            completion = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
            assert completion.status_code == 200
            stopped = http.post("/stop_profile").json()
            trace = Path(stopped["trace"])
            assert stopped["profiling"] is False and trace.parent == tmp_path / "traces"
            names = {event.get("name", "") for event in json.load(gzip.open(trace))["traceEvents"]}
            assert "ProfilerStep#1" in names and "kvloom::paged_attention" in names
            refused = http.post("/stop_profile")
            assert refused.status_code == 400 and "no profile is running" in refused.json()["error"]["message"]
        live.assert_idle_and_clean()
    finally:
        live.stop()


def test_without_a_directory_there_is_no_profiling(http: httpx.Client) -> None:
    assert http.post("/start_profile").status_code == 404
    assert http.post("/stop_profile").status_code == 404
