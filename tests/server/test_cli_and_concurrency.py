"""`kvloom serve` argument wiring, and many concurrent requests sharing the engine."""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_harness import SERVED_NAME, LiveServer

from kvloom.engine_args import engine_kwargs
from kvloom.server.cli import add_serve_parser
from kvloom.server.main import run_server
from kvloom.server.settings import ServerSettings


def test_serve_parser_wiring() -> None:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "some/model", "--port", "9001", "--api-key", "k",
                              "--max-waiting", "3", "--num-blocks", "8", "--host", "0.0.0.0"])
    assert (args.command, args.model, args.port, args.host) == ("serve", "some/model", 9001, "0.0.0.0")
    assert (args.api_key, args.max_waiting, args.max_body_bytes) == ("k", 3, 4 * 1024 * 1024)
    assert engine_kwargs(args)["num_blocks"] == 8


@pytest.mark.parametrize("kwargs, match", [
    ({"engine_kwargs": {"dtype": "int3"}}, "dtype"),
    ({"engine_kwargs": {"num_blocks": 0}}, "num_blocks"),
    ({"max_waiting": -1}, "max_waiting"),
    ({"settings_kwargs": {"max_body_bytes": 0}}, "max_body_bytes"),
])
def test_run_server_rejects_bad_settings_before_serving(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        settings = kwargs.pop("settings_kwargs", None)
        run_server("some/model", settings=None if settings is None else ServerSettings(**settings), **kwargs)


def test_concurrent_requests_all_complete(live_server: LiveServer) -> None:
    def one(i: int) -> httpx.Response:
        body = {"model": SERVED_NAME, "prompt": f"request number {i}", "max_tokens": 6,
                "ignore_eos": True, "stream": i % 2 == 0}
        return httpx.post(f"{live_server.base_url}/v1/completions", json=body, timeout=60)

    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(one, range(24)))
    assert all(r.status_code == 200 for r in responses)
    streamed = [r for i, r in enumerate(responses) if i % 2 == 0]
    assert all(r.text.rstrip().endswith("data: [DONE]") for r in streamed)
    assert all(r.json()["usage"]["completion_tokens"] == 6 for i, r in enumerate(responses) if i % 2)
    live_server.assert_idle_and_clean()
