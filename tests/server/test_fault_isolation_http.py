"""Hostile and unusual single requests get a 4xx and never take the engine down: the
payloads that once killed it are regressions here, each sent while a normal request
runs beside it. A real engine fault (an exception in the forward) fails the in-flight
requests with 500 and makes the server process exit non-zero."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import pytest
from server_harness import SERVED_NAME, wait_for_health

from kvloom.ports import reserve_ports

HOSTILE = [
    ({"seed": 1208925819614629174706176}, "seed"),  # 2**80
    ({"seed": -(2 ** 70)}, "seed"),
    ({"seed": 2 ** 64}, "seed"),
    ({"guided_regex": "(a{1000}){1000}"}, None),
    ({"temperature": 1e309}, "temperature"),  # JSON parses it to inf
    ({"stop_token_ids": [5, 10 ** 6]}, "stop_token_ids"),
    ({"stop": ["x"] * 65}, "stop"),
]


def completion(http: httpx.Client, **fields) -> httpx.Response:
    body = {"model": SERVED_NAME, "prompt": "Hi", "max_tokens": 2, **fields}
    return http.post("/v1/completions", content=json.dumps(body), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(("fields", "param"), HOSTILE, ids=[json.dumps(f)[:40] for f, _ in HOSTILE])
def test_hostile_payload_is_a_400_and_the_engine_keeps_serving(live_server, http, fields, param) -> None:
    neighbour: dict[str, httpx.Response] = {}

    def run_neighbour() -> None:
        with httpx.Client(base_url=live_server.base_url, timeout=60) as other:
            neighbour["response"] = completion(other, max_tokens=24, temperature=0.0, prompt="Hello there")

    thread = threading.Thread(target=run_neighbour)
    thread.start()
    response = completion(http, **fields)
    thread.join()
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param
    assert neighbour["response"].status_code == 200
    assert completion(http).status_code == 200  # still serving
    assert http.get("/health").status_code == 200
    live_server.assert_idle_and_clean()


def test_lone_surrogate_in_a_prompt_is_a_400(live_server, http) -> None:
    raw = '{"model": "' + SERVED_NAME + '", "prompt": "a \\ud800 b", "max_tokens": 2}'
    response = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert "prompt contains a lone UTF-16 surrogate" in response.json()["error"]["message"]
    assert completion(http).status_code == 200


def test_five_thousand_choices_are_served(live_server, http) -> None:
    options = [f"option {i}" for i in range(5000)]
    response = completion(http, guided_choice=options, max_tokens=8, temperature=0.0)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] in options
    live_server.assert_idle_and_clean()


ENGINE_FAULT_SERVER = textwrap.dedent("""
    import sys
    from kvloom.runner.model_runner import ModelRunner
    from kvloom.server.main import run_server
    from kvloom.server.settings import ServerSettings

    def broken_launch(self, output):
        raise RuntimeError("injected kernel fault")

    ModelRunner.launch = broken_launch
    sys.exit(run_server(sys.argv[1], dict(dtype="float32", num_blocks=32),
                        ServerSettings(served_model_name="tiny-llama"), port=int(sys.argv[2]), log_level="warning"))
""")


def test_an_engine_fault_fails_requests_with_500_and_exits_non_zero(tiny_llama: Path) -> None:
    port = reserve_ports(1)[0]
    process = subprocess.Popen([sys.executable, "-c", ENGINE_FAULT_SERVER, str(tiny_llama), str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_health(f"http://127.0.0.1:{port}")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            response = completion(http)
        assert response.status_code == 500, response.text
        assert response.json()["error"]["code"] == "engine_failed"
        log, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1, log
    assert "injected kernel fault" in log and "Traceback" in log  # the log says what happened


def test_engine_rejections_name_the_field_and_the_reason(tiny_llama: Path) -> None:
    from server_harness import start_live_server

    from kvloom.server.settings import ServerSettings

    live = start_live_server(tiny_llama, ServerSettings(served_model_name=SERVED_NAME), num_blocks=4,
                             max_model_len=512)
    try:
        with httpx.Client(base_url=live.base_url, timeout=60) as http:
            error = completion(http, max_tokens=200).json()["error"]  # 4 blocks of 16 tokens
            assert (error["param"], error["code"]) == ("max_tokens", "kv_pool_too_small")
            assert "needs 13 KV blocks, but the whole pool has 4" in error["message"]
            error = completion(http, prompt=[5] * 600).json()["error"]
            assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    finally:
        live.stop()
