"""`python -m kvloom.server` as a real process: SIGTERM/SIGINT end it with status 0,
aborting in-flight streams; a model that fails to load ends it with status 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import wait_for_health

from kvloom.ports import reserve_ports

REPO = Path(__file__).resolve().parents[2]


def start(model: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(
        [sys.executable, "-m", "kvloom.server", model, "--port", str(port), "--dtype", "float32",
         "--device", "cpu", "--num-blocks", "64", "--max-model-len", "256", "--num-threads", "1",
         "--log-level", "warning"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture
def process(tiny_llama: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    port = reserve_ports(1)[0]
    proc = start(str(tiny_llama), port)
    try:
        wait_for_health(f"http://127.0.0.1:{port}")
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_aborts_streams_and_exits_zero(process: tuple[subprocess.Popen, str]) -> None:
    proc, base_url = process
    body = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=base_url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
    assert proc.wait(timeout=30) == 0, proc.stdout.read() if proc.stdout else ""
    assert "shutting down" in rest[-1], rest[-3:]


def test_sigint_when_idle_exits_zero(process: tuple[subprocess.Popen, str]) -> None:
    proc, _ = process
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0


def test_model_that_fails_to_load_exits_one(tmp_path: Path) -> None:
    proc = start(str(tmp_path / "no-such-model"), reserve_ports(1)[0])
    try:
        output, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, output
    assert "no-such-model" in output


def test_an_in_process_server_whose_model_fails_to_load_raises_at_once(tiny_llama: Path) -> None:
    """start_background_server (the soak's and the tests' server) raises the load error
    as soon as the engine reports it, and stops the HTTP thread; it used to wait out its
    120-s deadline on /health's 503 and then name only the status."""
    from kvloom.config import EngineConfig
    from kvloom.engine.engine import LLMEngine
    from kvloom.server.background import start_background_server
    from kvloom.server.settings import ServerSettings

    config = EngineConfig.from_kwargs(str(tiny_llama), dtype="float32", num_blocks=8, max_model_len=4096)
    with pytest.raises(RuntimeError, match="failed to load: max_model_len 4096 is longer than the model allows"):
        start_background_server(lambda: LLMEngine(config), ServerSettings(served_model_name="x"),
                                startup_deadline=600)
