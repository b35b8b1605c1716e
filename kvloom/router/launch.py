"""``kvloom serve --data-parallel-size N``: N ``kvloom serve`` workers and a router;
``kvloom serve --role disaggregated``: a ``--role prefill`` and a ``--role decode``
worker and a disaggregated router (kvloom/router/disagg.py), the same way with N = 2.

The router's port is bound first (a port in use fails at once). Each worker is the
same command line without the router's flags (``ROUTER_FLAGS``), on a free loopback
port, pinned to its share of the cores, with ``--num-threads`` = max(1, cores // (N x
its tensor-parallel ranks)) unless given, so the workers do not fight over cores.
Every worker must answer ``/health`` before ``startup_timeout``; one
that exits first fails the start with its exit status (its log is on our stderr, as
the workers inherit it). On any exit, the workers get SIGTERM, then SIGKILL after
``STOP_GRACE_S``; on Linux they also get SIGTERM if this process dies without
cleaning up (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import httpx

from kvloom.ports import reserve_ports
from kvloom.router.config import RouterConfig
from kvloom.router.main import bind_socket, configure_logging, run_router
from kvloom.router.workers import RouterStartupError

# The flags that are the router's, not the workers' (with the number of values each takes).
ROUTER_FLAGS = {"--host": 1, "--port": 1, "--data-parallel-size": 1, "-dp": 1, "--router-policy": 1,
                "--cache-threshold": 1, "--balance-abs-threshold": 1, "--balance-rel-threshold": 1,
                "--max-tree-chars": 1, "--health-interval": 1, "--startup-timeout": 1}
# --role disaggregated: the workers get --role prefill and --role decode instead.
DISAGGREGATED_FLAGS = {**ROUTER_FLAGS, "--role": 1}
DISAGGREGATED_ROLES = (("--role", "prefill"), ("--role", "decode"))
STOP_GRACE_S = 10.0


def worker_argv(argv: Sequence[str], drop: dict[str, int] | None = None) -> list[str]:
    """``argv`` (``kvloom serve``'s arguments) without the router's flags and their
    values, in both spellings: ``--port 8000`` and ``--port=8000``."""
    drop = ROUTER_FLAGS if drop is None else drop
    kept: list[str] = []
    skip = 0
    for index, arg in enumerate(argv):
        if skip:
            skip -= 1
            continue
        if arg == "--":
            kept.extend(argv[index:])
            break
        name = arg.split("=", 1)[0]
        if name in drop:
            skip = 0 if "=" in arg else drop[name]
            continue
        kept.append(arg)
    return kept


def _die_with_parent() -> None:  # runs in the child before exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG = 1


def core_shares(count: int) -> list[tuple[int, ...] | None]:
    """The cores of this process split into ``count`` equal shares, one per worker
    (None each where there are fewer cores than workers: then the OS places them)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    share = len(cores) // count
    return [tuple(cores[i * share:(i + 1) * share]) if share else None for i in range(count)]


def worker_commands(argv: Sequence[str], ports: Sequence[int], num_threads: int | None,
                    extra: Sequence[Sequence[str]] | None = None) -> list[list[str]]:
    """The workers' command lines: ``kvloom serve`` with ``argv``, ``--num-threads`` when
    given, each worker's ``extra`` arguments, and its loopback port."""
    base = [sys.executable, "-m", "kvloom", "serve", *argv]
    if num_threads is not None:
        base += ["--num-threads", str(num_threads)]
    extras = [()] * len(ports) if extra is None else extra
    return [[*base, *more, "--host", "127.0.0.1", "--port", str(port)]
            for port, more in zip(ports, extras, strict=True)]


def start_workers(argv: Sequence[str], ports: Sequence[int], num_threads: int | None,
                  extra: Sequence[Sequence[str]] | None = None) -> list[subprocess.Popen[bytes]]:
    """One ``kvloom serve`` per port (``worker_commands``), each pinned to its share of
    the cores (a worker that is itself tensor parallel splits its share among its ranks)."""
    def placed(cores: tuple[int, ...] | None) -> Callable[[], None]:
        def before_exec() -> None:
            _die_with_parent()
            if cores:
                os.sched_setaffinity(0, cores)
        return before_exec

    return [subprocess.Popen(command, preexec_fn=placed(cores)) for command, cores in
            zip(worker_commands(argv, ports, num_threads, extra), core_shares(len(ports)), strict=True)]


def wait_until_healthy(processes: Sequence[subprocess.Popen[bytes]], urls: Sequence[str], timeout: float) -> None:
    """Poll every worker's ``/health`` until all are 200; RouterStartupError when one
    exits first or ``timeout`` passes (naming which worker and what it last said)."""
    deadline = time.monotonic() + timeout
    pending = dict(zip(urls, processes, strict=True))
    last: dict[str, str] = {url: "no answer" for url in urls}
    while pending:
        for url, process in list(pending.items()):
            code = process.poll()
            if code is not None:
                raise RouterStartupError(f"worker {url} exited with status {code} before it was ready "
                                         "(its log is above)")
            try:
                response = httpx.get(f"{url}/health", timeout=2.0)
                if response.status_code == 200:
                    del pending[url]
                    continue
                last[url] = f"/health answered {response.status_code}"
            except httpx.HTTPError as error:
                last[url] = repr(error)
        if pending and time.monotonic() > deadline:
            url = next(iter(pending))
            raise RouterStartupError(f"worker {url} was not ready within {timeout:g} s (last: {last[url]}); "
                                     "raise --startup-timeout for a slow model load")
        time.sleep(0.2)


def stop_workers(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def worker_threads(args: argparse.Namespace, size: int) -> int | None:
    """``--num-threads`` for each of ``size`` workers: None where the command gives it
    (the workers get it as given), else each worker's share of the cores, split again
    among its tensor-parallel ranks."""
    if args.num_threads is not None:
        return None
    return max(1, (os.cpu_count() or 1) // (size * getattr(args, "tensor_parallel_size", 1)))


def run_data_parallel(args: argparse.Namespace, argv: Sequence[str],
                      router_config: Callable[[list[str]], RouterConfig]) -> int:
    """``argv``: this ``kvloom serve`` command's arguments (after ``serve``);
    ``router_config``: the router's configuration for the workers' URLs."""
    size = args.data_parallel_size
    return _serve_behind_router(args, worker_argv(argv), [()] * size, router_config)


def run_disaggregated(args: argparse.Namespace, argv: Sequence[str],
                      router_config: Callable[[list[str], list[str]], RouterConfig]) -> int:
    """``kvloom serve --role disaggregated``: one prefill and one decode worker (``argv``
    without the router's flags and ``--role``) behind a disaggregated router;
    ``router_config``: its configuration for the prefill and the decode URLs."""
    return _serve_behind_router(args, worker_argv(argv, DISAGGREGATED_FLAGS), DISAGGREGATED_ROLES,
                                lambda urls: router_config(urls[:1], urls[1:]))


def _serve_behind_router(args: argparse.Namespace, argv: Sequence[str], extra: Sequence[Sequence[str]],
                         router_config: Callable[[list[str]], RouterConfig]) -> int:
    """Bind the router's port, start one worker per ``extra`` (its own arguments), wait
    for all, then run the router (``router_config`` of their URLs) until it stops."""
    size = len(extra)
    configure_logging(args.log_level)
    sock = bind_socket(args.host, args.port)
    num_threads = worker_threads(args, size)
    ports = reserve_ports(size)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    named = ", ".join(f"{url} ({' '.join(more)})" if more else url for url, more in zip(urls, extra, strict=True))
    print(f"kvloom: starting {size} workers on {named}"
          + (f" with --num-threads {num_threads}" if num_threads else ""), file=sys.stderr)
    processes = start_workers(argv, ports, num_threads, extra)
    try:
        wait_until_healthy(processes, urls, args.startup_timeout)
        return run_router(router_config(urls), host=args.host, port=args.port, log_level=args.log_level,
                          sock=sock)
    finally:
        sock.close()
        stop_workers(processes)
