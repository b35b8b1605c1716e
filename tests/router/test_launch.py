"""`kvloom serve --data-parallel-size N` and `kvloom router`: flags, the launcher's
start and stop, and the errors that end a start."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from router_harness import wait_for

from kvloom.cli import build_parser, main
from kvloom.ports import reserve_ports
from kvloom.router.launch import wait_until_healthy, worker_argv
from kvloom.router.workers import RouterStartupError


def test_worker_argv_drops_the_router_flags_in_both_spellings() -> None:
    argv = ["MODEL", "--port", "9000", "--host=0.0.0.0", "--data-parallel-size", "2", "-dp", "2",
            "--router-policy=round_robin", "--cache-threshold", "0.7", "--num-blocks", "64",
            "--served-model-name", "a", "b", "--api-key", "k"]
    assert worker_argv(argv) == ["MODEL", "--num-blocks", "64", "--served-model-name", "a", "b",
                                 "--api-key", "k"]


@pytest.mark.parametrize("argv", [
    ["serve", "MODEL", "--data-parallel", "2"], ["serve", "MODEL", "--data-parallel-s=2"],
    ["serve", "MODEL", "--router-pol", "round_robin"], ["router", "--worker", "http://x:1", "--pol", "round_robin"],
])
def test_abbreviated_flags_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """The workers run this command line minus the router's flags, found by their full
    names: an abbreviation argparse accepted (``--data-parallel 2``) reached every
    worker, each of which started two more, without end. No parser takes them."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_router_flags_parse_to_a_config() -> None:
    from kvloom.router.cli import router_config

    args = build_parser().parse_args(["router", "--worker", "localhost:8001", "--worker", "http://h:8002/",
                                      "--policy", "round_robin", "--cache-threshold", "0.8"])
    config = router_config(args, args.worker)
    assert config.workers == ("http://localhost:8001", "http://h:8002")
    assert config.policy == "round_robin" and config.policy_config.cache_threshold == 0.8
    serve = build_parser().parse_args(["serve", "--data-parallel-size", "2", "--router-policy", "least_loaded"])
    assert serve.data_parallel_size == 2 and serve.router_policy == "least_loaded"


def test_bad_router_flags_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", "--worker", "ftp://x:1"]) == 2
    assert "not a worker URL" in capsys.readouterr().err
    assert main(["router", "--worker", "http://x:1", "--cache-threshold", "2"]) == 2
    assert "cache_threshold" in capsys.readouterr().err


def test_router_port_in_use_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["router", "--worker", "http://127.0.0.1:1", "--port", str(port)]) == 2
    assert f"port {port} on 127.0.0.1 is already in use" in capsys.readouterr().err


def test_an_unreachable_worker_fails_the_start_by_the_deadline(capsys: pytest.CaptureFixture[str]) -> None:
    (port,) = reserve_ports(1)
    assert main(["router", "--worker", f"http://127.0.0.1:{port}", "--port", "0",
                 "--startup-timeout", "0.3"]) == 2
    assert f"worker http://127.0.0.1:{port} did not answer" in capsys.readouterr().err


def test_a_worker_that_exits_fails_the_start_with_its_status() -> None:
    (port,) = reserve_ports(1)
    process = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(RouterStartupError, match=f"127.0.0.1:{port} exited with status 3"):
        wait_until_healthy([process], [f"http://127.0.0.1:{port}"], timeout=30)


def test_data_parallel_needs_its_own_command_line() -> None:
    # Called from Python with an argv that is not sys.argv, the workers' command line is unknown.
    assert main(["serve", "MODEL", "--data-parallel-size", "2"]) == 2


def _kvloom(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "kvloom", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_launcher(process: subprocess.Popen[str], base: str, what: str) -> None:
    """Until ``base``/health answers 200; the launcher exiting first fails with its output."""
    def healthy() -> bool:
        assert process.poll() is None, process.communicate()[0]
        try:
            return httpx.get(f"{base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
    wait_for(healthy, timeout=120, what=what)


def test_serve_data_parallel_port_in_use_fails_before_starting_workers(tiny_llama: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = _kvloom("serve", str(tiny_llama), "--data-parallel-size", "2", "--port", str(port))
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 2, output
    assert f"port {port} on 127.0.0.1 is already in use" in output and "starting" not in output


def test_serve_data_parallel_starts_routes_and_stops_its_workers(tiny_llama: Path) -> None:
    (port,) = reserve_ports(1)
    process = _kvloom("serve", str(tiny_llama), "--dtype", "float32", "--num-blocks", "64",
                      "--data-parallel-size", "2", "--port", str(port), "--disable-log-stats",
                      "--log-level", "warning")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_launcher(process, base, "the router and its workers")
        workers = list(httpx.get(f"{base}/health").json()["workers"])
        assert len(workers) == 2
        response = httpx.post(f"{base}/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    finally:
        os.kill(process.pid, signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    for url in workers:  # the workers went with it
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)


def test_serve_disaggregated_starts_a_pair_and_a_router_and_moves_kv(tiny_llama: Path, tmp_path: Path) -> None:
    (port,) = reserve_ports(1)
    process = _kvloom("serve", str(tiny_llama), "--dtype", "float32", "--num-blocks", "64", "--role",
                      "disaggregated", "--kv-shm-dir", str(tmp_path), "--port", str(port), "--disable-log-stats",
                      "--log-level", "warning")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_launcher(process, base, "the router and its prefill and decode instances")
        health = httpx.get(f"{base}/health").json()
        assert len(health["prefill"]) == 1 and len(health["decode"]) == 1
        response = httpx.post(f"{base}/v1/completions", json={"prompt": "hello there, old friend",
                                                               "max_tokens": 3}, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
        metrics = httpx.get(f"{base}/metrics").text
        assert "kvloom:kv_transfer_imports_total 1.0" in metrics  # summed over both instances
    finally:
        os.kill(process.pid, signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    assert list(tmp_path.iterdir()) == []  # the staged file was pulled and removed
