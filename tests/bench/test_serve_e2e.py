"""End to end: `kvloom bench serve` against a live `kvloom serve` subprocess on the tiny model."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvloom.bench.sweep import ManagedServer
from kvloom.cli import main
from kvloom.ports import reserve_ports

STARTUP_DEADLINE_S = 60.0
NUM_REQUESTS = 8


def _serve_command() -> list[str]:
    """``python -m kvloom serve`` once the CLI has the subcommand; until then the
    server package's own entry point, which takes the same arguments."""
    from kvloom.cli import build_parser

    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        try:
            build_parser().parse_args(["serve", "--help"])
        except SystemExit as exit_:
            wired = exit_.code == 0  # help printed; an unknown subcommand exits with 2
    if wired:
        return [sys.executable, "-m", "kvloom", "serve"]
    return [sys.executable, "-m", "kvloom.server"]


@pytest.fixture(scope="module")
def kvloom_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = reserve_ports(1)[0]
    command = [*_serve_command(), str(tiny_llama), "--dtype", "float32", "--device", "cpu",
               "--num-blocks", "128", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    log = tmp_path_factory.mktemp("server") / "server.log"
    server = ManagedServer(command, f"http://127.0.0.1:{port}", log)
    server.start(STARTUP_DEADLINE_S)  # raises with the log's tail if it dies or hangs
    process = server.process
    try:
        yield server.base_url
    finally:
        code = server.stop(timeout_s=30)
        assert process is not None and code is not None, "server did not exit"
        assert code == 0, f"server exited with {code} after SIGTERM:\n{server.log_tail()}"


def test_bench_serve_against_live_kvloom(kvloom_server: str, tiny_llama: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "result.json"
    status = main(["bench", "serve", "--base-url", kvloom_server, "--tokenizer", str(tiny_llama),
                   "--dataset", "random", "--num-prompts", str(NUM_REQUESTS), "--random-input-len", "24",
                   "--random-output-len", "8", "--request-rate", "inf", "--max-concurrency", "4",
                   "--ignore-eos", "--num-warmups", "1", "--seed", "3", "--no-progress",
                   "--label", "tiny", "--output-json", str(out)])
    assert status == 0
    assert "Successful requests:" in capsys.readouterr().out
    result = json.loads(out.read_text())
    metrics = result["metrics"]
    assert metrics["completed"] == NUM_REQUESTS and metrics["failed"] == 0, metrics["errors"]
    assert metrics["total_input_tokens"] > 0
    # ignore_eos: every request generates exactly its max_tokens, counted from usage.
    assert metrics["total_output_tokens"] == 8 * NUM_REQUESTS
    assert metrics["ttft_ms"]["count"] == NUM_REQUESTS and metrics["ttft_ms"]["mean"] > 0
    assert metrics["tpot_ms"]["mean"] > 0 and metrics["output_throughput"] > 0
    records = result["requests"]
    assert all(r["usage_reported"] and r["output_len"] == 8 and r["ttft"] > 0 for r in records)
    assert all(r["server_prompt_tokens"] >= r["prompt_len"] for r in records)
    assert result["label"] == "tiny" and len(result["fingerprint"]) == 64
    # kvloom's /metrics was scraped before and after the run.
    assert result["server_counters"]["kvloom:prefix_cache_queries_total"] > 0
    assert "kvloom:num_preemptions_total" in result["server_counters"]


def test_kvloom_serve_help_lists_the_server_flags() -> None:
    """Documents the entry point the sweep launches (and that the e2e test uses)."""
    help_text = subprocess.run([*_serve_command(), "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    for flag in ("--port", "--host", "--num-blocks", "--no-prefix-cache"):
        assert flag in help_text


def test_bench_serve_takes_the_tokenizer_of_the_model_the_server_serves(
        kvloom_server: str, tiny_llama: Path, tmp_path: Path) -> None:
    """No --tokenizer: the workload is measured with the served model's tokenizer (its
    /v1/models root), so prompt lengths count the same tokens the server does."""
    out = tmp_path / "result.json"
    status = main(["bench", "serve", "--base-url", kvloom_server, "--dataset", "random", "--num-prompts", "2",
                   "--random-input-len", "24", "--random-output-len", "2", "--ignore-eos", "--num-warmups", "0",
                   "--no-progress", "--output-json", str(out)])
    assert status == 0
    result = json.loads(out.read_text())
    assert result["parameters"]["workload"]["tokenizer"] == str(tiny_llama)
    assert all(r["server_prompt_tokens"] >= r["prompt_len"] > 0 for r in result["requests"])
