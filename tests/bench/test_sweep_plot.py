"""`bench sweep` (server lifecycle, cells, summary) with a fake server, `bench plot`,
and the `bench serve` flags."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from kvloom.bench.plot import plot_results, series_by_label
from kvloom.bench.sweep import ManagedServer, SweepConfig, engine_flags, format_summary, run_sweep
from kvloom.cli import build_parser, main

FAKE_SERVER = str(Path(__file__).with_name("fake_openai_server.py"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_engine_flags() -> None:
    assert engine_flags(["--no-prefix-cache"]) == ["--no-prefix-cache"]
    assert engine_flags({"policy": "lpm", "no_prefix_cache": True, "trace": False,
                         "max-num-seqs": 8, "x": None}) == [
        "--policy", "lpm", "--no-prefix-cache", "--max-num-seqs", "8"]
    with pytest.raises(ValueError):
        engine_flags("--no-prefix-cache")  # a bare string is a mistake, not a list of chars


def test_sweep_config_validation() -> None:
    config = SweepConfig.from_dict({"model": "m", "request_rates": [1, "inf"],
                                    "engine_options": {"on": [], "off": {"no_prefix_cache": True}}})
    assert config.request_rates == [1.0, math.inf]
    assert config.engine_options == {"on": [], "off": ["--no-prefix-cache"]}
    with pytest.raises(ValueError, match="unknown"):
        SweepConfig.from_dict({"model": "m", "request_rates": [1], "engine_options": {"a": []}, "rates": 1})
    with pytest.raises(ValueError, match="request_rates"):
        SweepConfig.from_dict({"model": "m", "request_rates": [], "engine_options": {"a": []}})
    with pytest.raises(ValueError, match="engine_options"):
        SweepConfig.from_dict({"model": "m", "request_rates": [1], "engine_options": {}})


def test_sweep_runs_every_cell_and_stops_its_servers(tiny_llama: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    config_path = tmp_path / "sweep.json"
    config_path.write_text(json.dumps({
        "model": "unused", "request_rates": ["inf", 50],
        "engine_options": {"fast": [], "slow": ["--delay", "0.01"]},
        "server_command": [sys.executable, FAKE_SERVER, "--port", "{port}"],
        "bench_args": ["--tokenizer", str(tiny_llama), "--dataset", "random", "--num-prompts", "4",
                       "--random-input-len", "8", "--random-output-len", "4", "--no-progress"],
        "startup_timeout_s": 30, "shutdown_timeout_s": 10}))
    out = tmp_path / "out"
    assert main(["bench", "sweep", str(config_path), "--output-dir", str(out)]) == 0
    cells = sorted(p.name for p in out.glob("*.json"))
    assert cells == ["fast_rate-50.json", "fast_rate-inf.json", "slow_rate-50.json",
                     "slow_rate-inf.json", "summary.json"]
    fingerprints = {}
    for name in cells[:-1]:
        result = json.loads((out / name).read_text())
        assert result["metrics"]["completed"] == 4 and result["label"] == name.split("_")[0]
        assert result["server_counters"]["kvloom:prefix_cache_queries_total"] == 160
        fingerprints[name] = result["fingerprint"]
    # The same workload for every engine option set; the rate is part of the workload.
    assert fingerprints["fast_rate-inf.json"] == fingerprints["slow_rate-inf.json"]
    assert fingerprints["fast_rate-50.json"] == fingerprints["slow_rate-50.json"]
    assert fingerprints["fast_rate-50.json"] != fingerprints["fast_rate-inf.json"]
    rows = json.loads((out / "summary.json").read_text())
    assert [(r["label"], r["request_rate"], r["error"]) for r in rows] == [
        ("fast", "inf", None), ("fast", "50", None), ("slow", "inf", None), ("slow", "50", None)]
    assert "out tok/s" in capsys.readouterr().out
    assert len(list(out.glob("*.server.log"))) == 4  # a fresh server per cell

    # Plot the sweep's own results.
    pngs = plot_results(sorted(out.glob("*_rate-*.json")), tmp_path / "plots")
    assert [p.name for p in pngs] == ["latency_vs_throughput.png", "throughput.png"]
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in pngs)


def test_sweep_over_concurrency_caps(tiny_llama: Path, tmp_path: Path) -> None:
    config = SweepConfig.from_dict({
        "model": "unused", "max_concurrencies": [1, 3], "num_prompts_by_concurrency": {"1": 2},
        "engine_options": {"e": []}, "output_dir": str(tmp_path),
        "server_command": [sys.executable, FAKE_SERVER, "--port", "{port}"],
        "bench_args": ["--tokenizer", str(tiny_llama), "--dataset", "random", "--num-prompts", "5",
                       "--random-input-len", "8", "--random-output-len", "4", "--no-progress"],
        "startup_timeout_s": 30, "shutdown_timeout_s": 10})
    assert config.request_rates == [math.inf]  # caps alone: every request sent at once, capped
    assert run_sweep(config) == 0
    c1 = json.loads((tmp_path / "e_rate-inf_c1.json").read_text())
    c3 = json.loads((tmp_path / "e_rate-inf_c3.json").read_text())
    # The first 2 of the same workload at cap 1; all 5 at cap 3.
    assert (c1["metrics"]["completed"], c1["parameters"]["max_concurrency"]) == (2, 1)
    assert (c3["metrics"]["completed"], c3["parameters"]["max_concurrency"]) == (5, 3)
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert [(r["max_concurrency"], r["completed"]) for r in rows] == [(1, 2), (3, 5)]
    # A second engine swept into the same directory: both engines' rows stay.
    other = dataclasses.replace(config, engine_options={"other": []}, max_concurrencies=[1])
    assert run_sweep(other) == 0
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert [(r["label"], r["max_concurrency"]) for r in rows] == [("e", 1), ("e", 3), ("other", 1)]
    series = series_by_label([c3, c1])  # load order: the lower cap first
    assert [r["parameters"]["max_concurrency"] for r in series["e"]] == [1, 3]
    with pytest.raises(ValueError, match="max_concurrencies"):
        SweepConfig.from_dict({"model": "m", "max_concurrencies": [0], "engine_options": {"a": []}})


def test_sweep_reports_servers_that_never_become_healthy(tiny_llama: Path, tmp_path: Path) -> None:
    config = SweepConfig.from_dict({
        "model": "m", "request_rates": [1], "output_dir": str(tmp_path),
        "engine_options": {"dies": []}, "startup_timeout_s": 20,
        "server_command": [sys.executable, "-c", "import sys; print('bad flag {port}'); sys.exit(3)"],
        "bench_args": ["--tokenizer", str(tiny_llama), "--dataset", "random", "--num-prompts", "1",
                       "--random-input-len", "4", "--random-output-len", "2"]})
    assert run_sweep(config) == 1
    row = json.loads((tmp_path / "summary.json").read_text())[0]
    assert "exited with 3" in row["error"] and "bad flag" in row["error"]
    assert "error:" in format_summary([row])


def test_health_deadline_kills_a_silent_server(tmp_path: Path) -> None:
    server = ManagedServer([sys.executable, "-c", "import time; time.sleep(60)"],
                           "http://127.0.0.1:9", tmp_path / "log")
    with pytest.raises(RuntimeError, match="not healthy"):
        server.start(timeout_s=1.0)
    assert server.process is None  # stopped, not leaked


def _fake_result(label: str, rate: float | str, throughput: float, ttft: float) -> dict[str, Any]:
    dist = {"count": 1, "mean": ttft, "median": ttft, "std": 0.0, "p90": ttft, "p99": ttft * 2}
    return {"label": label, "parameters": {"request_rate": rate},
            "metrics": {"output_throughput": throughput, "ttft_ms": dist, "tpot_ms": dist}}


def test_plot_writes_pngs_and_groups_by_label(tmp_path: Path) -> None:
    paths = []
    for label, scale in (("prefix-on", 1.0), ("prefix-off", 0.7)):
        for rate in (1, 4, "inf"):
            path = tmp_path / f"{label}-{rate}.json"
            rate_value = math.inf if rate == "inf" else rate
            path.write_text(json.dumps(_fake_result(label, rate, 100 * scale * min(rate_value, 8),
                                                    10 * min(rate_value, 8))))
            paths.append(str(path))
    series = series_by_label([json.loads(Path(p).read_text()) for p in reversed(paths)])
    assert list(series) == ["prefix-off", "prefix-on"]
    assert [r["parameters"]["request_rate"] for r in series["prefix-on"]] == [1, 4, "inf"]
    assert main(["bench", "plot", *paths, "--out", str(tmp_path / "plots")]) == 0
    for name in ("latency_vs_throughput.png", "throughput.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a bench serve results"):
        plot_results([tmp_path / "bad.json"], tmp_path)


def test_serve_flags_map_to_the_config() -> None:
    from kvloom.bench.serve_args import serve_config

    parser = build_parser()
    args = parser.parse_args(["bench", "serve", "--dataset", "multiturn", "--request-rate", "inf",
                              "--slo", "ttft:100", "--extra-body", '{"top_k": 1}', "--max-concurrency", "3"])
    config = serve_config(args)
    assert config.endpoint == "/v1/chat/completions" and math.isinf(config.request_rate)
    assert config.slo == {"ttft": 100.0} and config.extra_body == {"top_k": 1}
    assert config.max_concurrency == 3 and config.workload["dataset"] == "multiturn"
    assert config.history == "dataset"
    assert serve_config(parser.parse_args(["bench", "serve", "--dataset", "multiturn", "--history",
                                           "generated"])).history == "generated"
    with pytest.raises(ValueError, match="--history generated is for --dataset multiturn"):
        serve_config(parser.parse_args(["bench", "serve", "--history", "generated"]))
    args = parser.parse_args(["bench", "serve", "--dataset", "multiturn", "--endpoint", "/v1/completions"])
    with pytest.raises(ValueError, match="multiturn"):
        serve_config(args)
    assert serve_config(parser.parse_args(["bench", "serve"])).endpoint == "/v1/completions"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "serve", "--request-rate", "0"])


def test_plot_without_the_bench_extra_is_one_line_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_fake_result("a", 1, 10.0, 5.0)))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without [bench] looks like
    assert main(["bench", "plot", str(path), "--out", str(tmp_path / "plots")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'matplotlib'" in err[0] and "pip install 'kvloom[bench]'" in err[0]
