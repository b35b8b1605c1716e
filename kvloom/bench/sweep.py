"""`kvloom bench sweep CONFIG.json`: ``bench serve`` over request rates x concurrencies x engine options.

For every engine option set it starts a server (by default ``sys.executable -m
kvloom serve MODEL --host H --port P <server_args> <options>``), waits for
``/health`` within a deadline, runs the same workload at each request rate, and
stops the server with SIGTERM (SIGKILL if it outlives ``shutdown_timeout_s``).
By default every cell gets a fresh server: the workload is identical across
rates, so a server kept warm would answer later rates from its prefix cache.

The config (JSON)::

    {"model": "smollm2-135m-instruct",
     "request_rates": [1, 4, "inf"],
     "engine_options": {"prefix-on": [], "prefix-off": ["--no-prefix-cache"],
                        "lpm": {"policy": "lpm"}},
     "server_args": ["--dtype", "float32"],
     "bench_args": ["--dataset", "prefix", "--num-prompts", "64", "--tokenizer", "..."],
     "output_dir": "bench-sweep"}

Optional: ``max_concurrencies`` (a list; each cell caps the requests in flight at
one of them, ``null`` for no cap: the default ``[null]``; with a list of caps,
``request_rates`` defaults to ``["inf"]``), ``num_prompts_by_concurrency`` (an
object from a cap to the number of the workload's requests its cells send, the
first ones; a sweep from 1 to 256 in flight need not send 200 requests one at a
time), ``host``, ``port`` (default: a free port per server),
``startup_timeout_s`` (600), ``shutdown_timeout_s`` (60), ``restart_per_rate``
(true), and ``server_command``, a list with ``{model}``, ``{host}`` and
``{port}`` placeholders to sweep another engine (options are appended to it).
Option sets are flag lists or ``{flag: value}`` objects (``true``: a bare flag,
``false``/``null``: omitted). Each cell writes ``<label>_rate-<rate>.json`` and
its server's log (``<label>_rate-<rate>_c<cap>`` when capped); ``summary.json``
and a printed table close the sweep. A sweep into a directory that holds another
sweep's summary keeps that one's rows of other labels, so two engines swept one
after the other (each with its own ``server_command``) share one summary.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from kvloom.bench.serve_args import add_serve_bench_args, resolve_tokenizer, sample_workload, serve_config
from kvloom.ports import reserve_ports

__all__ = ["ManagedServer", "SweepConfig", "engine_flags", "format_summary", "run_sweep"]


@dataclass(frozen=True)
class SweepConfig:
    """A sweep grid; see the module docstring for the JSON form."""

    model: str
    request_rates: list[float]
    engine_options: dict[str, list[str]]
    max_concurrencies: list[int | None] = field(default_factory=lambda: [None])
    num_prompts_by_concurrency: dict[int, int] = field(default_factory=dict)
    bench_args: list[str] = field(default_factory=list)
    server_args: list[str] = field(default_factory=list)
    output_dir: str = "bench-sweep"
    host: str = "127.0.0.1"
    port: int | None = None
    startup_timeout_s: float = 600.0
    shutdown_timeout_s: float = 60.0
    restart_per_rate: bool = True
    server_command: list[str] | None = None

    def __post_init__(self) -> None:
        if not self.request_rates or not all(rate > 0 for rate in self.request_rates):
            raise ValueError(f"request_rates must be non-empty and > 0, got {self.request_rates}")
        if not self.engine_options:
            raise ValueError("engine_options needs at least one option set (e.g. {\"default\": []})")
        if not self.max_concurrencies or not all(c is None or c >= 1 for c in self.max_concurrencies):
            raise ValueError(f"max_concurrencies must be non-empty, each null or >= 1, "
                             f"got {self.max_concurrencies}")
        if not all(n >= 1 for n in self.num_prompts_by_concurrency.values()):
            raise ValueError(f"num_prompts_by_concurrency values must be >= 1, "
                             f"got {self.num_prompts_by_concurrency}")

    def cells(self) -> list[tuple[float, int | None]]:
        """(request rate, concurrency cap) of every cell of one option set, in order."""
        return [(rate, cap) for rate in self.request_rates for cap in self.max_concurrencies]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SweepConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown sweep config keys: {sorted(unknown)}")
        values = dict(data)
        caps = values.get("max_concurrencies")
        if caps is not None:
            values["max_concurrencies"] = [None if cap is None else int(cap) for cap in caps]
        values["num_prompts_by_concurrency"] = {
            int(cap): int(n) for cap, n in values.get("num_prompts_by_concurrency", {}).items()}
        default_rates = ["inf"] if caps is not None else []
        values["request_rates"] = [float(rate) for rate in values.get("request_rates", default_rates)]
        values["engine_options"] = {str(label): engine_flags(options)
                                    for label, options in values.get("engine_options", {}).items()}
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | Path) -> SweepConfig:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


def engine_flags(options: Sequence[str] | Mapping[str, Any]) -> list[str]:
    """An option set as command-line flags: a list passes through; ``{"policy": "lpm",
    "no_prefix_cache": true}`` becomes ``["--policy", "lpm", "--no-prefix-cache"]``."""
    if isinstance(options, Mapping):
        flags: list[str] = []
        for key, value in options.items():
            flag = "--" + str(key).lstrip("-").replace("_", "-")
            if value is True:
                flags.append(flag)
            elif value is not False and value is not None:
                flags += [flag, str(value)]
        return flags
    if isinstance(options, str) or not all(isinstance(item, str) for item in options):
        raise ValueError(f"an option set is a list of flag strings or an object, got {options!r}")
    return list(options)


class ManagedServer:
    """A server subprocess: ``start`` waits for ``/health``; ``stop`` sends SIGTERM and waits."""

    def __init__(self, command: Sequence[str], base_url: str, log_path: Path) -> None:
        self.command, self.base_url, self.log_path = list(command), base_url, log_path
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self, timeout_s: float) -> None:
        """Launch and wait until ``/health`` answers 200; on a timeout or an early exit,
        stop the process and raise ``RuntimeError`` with the log's tail."""
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                self.stop()
                raise RuntimeError(f"server exited with {code} before becoming healthy:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; returns the exit status."""
        process, self.process = self.process, None
        code = None
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            code = process.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-chars:].decode("utf-8", errors="replace")
        except OSError:
            return "(no log)"

    def __enter__(self) -> ManagedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _server_command(config: SweepConfig, options: list[str], port: int) -> list[str]:
    if config.server_command:
        values = {"model": config.model, "host": config.host, "port": port}
        return [part.format(**values) for part in config.server_command] + options
    return [sys.executable, "-m", "kvloom", "serve", config.model, "--host", config.host,
            "--port", str(port), *config.server_args, *options]


def _rate_name(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _cell_name(label: str, rate: float, cap: int | None) -> str:
    return f"{label}_rate-{_rate_name(rate)}" + ("" if cap is None else f"_c{cap}")


def _summary_row(label: str, rate: float, cap: int | None, result: Mapping[str, Any] | None,
                 error: str | None) -> dict[str, Any]:
    row: dict[str, Any] = {"label": label, "request_rate": _rate_name(rate), "max_concurrency": cap,
                           "error": error}
    if result is not None:
        metrics = result["metrics"]
        row.update(completed=metrics["completed"], failed=metrics["failed"],
                   request_throughput=metrics["request_throughput"],
                   output_throughput=metrics["output_throughput"],
                   mean_ttft_ms=metrics["ttft_ms"]["mean"], p99_ttft_ms=metrics["ttft_ms"]["p99"],
                   mean_tpot_ms=metrics["tpot_ms"]["mean"], p99_tpot_ms=metrics["tpot_ms"]["p99"],
                   prefix_hit_rate=_counter(result, "prefix_cache_hit_rate"),
                   spec_acceptance_rate=_counter(result, "spec_decode_acceptance_rate"),
                   spec_mean_accepted_length=_counter(result, "spec_decode_mean_accepted_length"))
    return row


def _counter(result: Mapping[str, Any], suffix: str) -> float | None:
    """A derived server counter of the cell (any engine's prefix), None when absent."""
    return next((v for k, v in result["server_counters"].items() if k.endswith(suffix)), None)


def format_summary(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line per cell: throughput, TTFT/TPOT (mean, p99), prefix-cache hit rate and,
    where drafts were verified, the acceptance rate and mean accepted length."""
    speculative = any(row.get("spec_acceptance_rate") is not None for row in rows)
    header = (f"{'label':<20}{'rate':>7}{'cap':>5}{'ok':>6}{'fail':>6}{'req/s':>8}{'out tok/s':>11}"
              f"{'TTFT ms':>9}{'p99':>9}{'TPOT ms':>9}{'p99':>9}{'hit':>7}"
              + (f"{'accept':>8}{'len':>6}" if speculative else ""))
    lines = [header, "-" * len(header)]
    for row in rows:
        cap = row.get("max_concurrency")
        start = f"{row['label'][:19]:<20}{row['request_rate']:>7}{'-' if cap is None else cap:>5}"
        if row.get("error"):
            lines.append(f"{start}  error: {row['error'].splitlines()[0][:80]}")
            continue
        hit = "-" if row["prefix_hit_rate"] is None else f"{row['prefix_hit_rate']:.2f}"
        lines.append(f"{start}{row['completed']:>6}{row['failed']:>6}{row['request_throughput']:>8.2f}"
                     f"{row['output_throughput']:>11.1f}{row['mean_ttft_ms']:>9.1f}"
                     f"{row['p99_ttft_ms']:>9.1f}{row['mean_tpot_ms']:>9.1f}{row['p99_tpot_ms']:>9.1f}"
                     f"{hit:>7}" + (_speculative_columns(row) if speculative else ""))
    return "\n".join(lines)


def _speculative_columns(row: Mapping[str, Any]) -> str:
    rate, length = row.get("spec_acceptance_rate"), row.get("spec_mean_accepted_length")
    return f"{rate:>8.1%}{length or 1.0:>6.2f}" if rate is not None else f"{'-':>8}{'-':>6}"


def run_sweep(config: SweepConfig) -> int:
    """Run every cell; returns 0 when all cells ran, 1 when any server failed to start."""
    from kvloom.bench.serve import run_benchmark, save_result

    parser = argparse.ArgumentParser(prog="bench_args")
    add_serve_bench_args(parser)
    args = parser.parse_args(config.bench_args)
    resolve_tokenizer(args, default=config.model)  # the servers it starts serve config.model
    base_config = serve_config(args)
    requests = sample_workload(args)  # once: every cell replays exactly the same workload
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for label, options in config.engine_options.items():
        server: ManagedServer | None = None
        try:
            for rate, cap in config.cells():
                cell = _cell_name(label, rate, cap)
                result, error = None, None
                try:
                    if server is None:
                        port = config.port or reserve_ports(1, config.host)[0]
                        server = ManagedServer(_server_command(config, options, port),
                                               f"http://{config.host}:{port}", out / f"{cell}.server.log")
                        print(f"[{cell}] starting: {' '.join(server.command)}", file=sys.stderr)
                        server.start(config.startup_timeout_s)
                    cell_config = dataclasses.replace(base_config, base_url=server.base_url,
                                                      request_rate=rate, max_concurrency=cap or
                                                      base_config.max_concurrency, label=label)
                    command = f"{shlex.join(sys.argv)}  # cell {cell}"
                    count = config.num_prompts_by_concurrency.get(cap, len(requests)) if cap else len(requests)
                    result = asyncio.run(run_benchmark(cell_config, requests[:count], command))
                    save_result(str(out / f"{cell}.json"), result)
                except (RuntimeError, ValueError) as failure:  # this cell fails; the sweep goes on
                    error = str(failure)
                    print(f"[{cell}] {error}", file=sys.stderr)
                if server is not None and (config.restart_per_rate or error is not None):
                    server.stop(config.shutdown_timeout_s)
                    server = None
                rows.append(_summary_row(label, rate, cap, result, error))
        finally:  # also on Ctrl-C: never leave a server running
            if server is not None:
                server.stop(config.shutdown_timeout_s)
    summary = out / "summary.json"
    labels = set(config.engine_options)
    earlier = json.loads(summary.read_text(encoding="utf-8")) if summary.exists() else []
    kept = [row for row in earlier if row.get("label") not in labels]
    summary.write_text(json.dumps(kept + rows, indent=1) + "\n", encoding="utf-8")
    print(format_summary(rows))
    return 1 if any(row["error"] for row in rows) else 0
