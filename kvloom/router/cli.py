"""`kvloom router --worker URL ...` (or ``--prefill URL ... --decode URL ...``) and the
launchers' flags on ``kvloom serve`` (``--data-parallel-size N``, ``--role
disaggregated``): argument parsing only; the work is in ``run_router`` and
kvloom/router/launch.py.

Imported by kvloom/cli.py at start, so it imports nothing heavy: the router's modules
load when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvloom.engine_args import port_number
from kvloom.server.cli import add_cors_args, cors_settings

if TYPE_CHECKING:
    from kvloom.router.config import RouterConfig

ROUTER_POLICIES = ("cache_aware", "round_robin", "least_loaded")  # kvloom/router/policy.py's registry


def add_policy_args(group: argparse._ArgumentGroup, policy_flag: str = "--policy") -> None:
    """The routing flags, shared by ``kvloom router`` and ``kvloom serve --data-parallel-size``."""
    group.add_argument(policy_flag, dest="router_policy", default="cache_aware", choices=ROUTER_POLICIES,
                       help="how requests are spread: cache_aware (the worker most likely to hold the "
                            "prompt's prefix unless it is loaded beyond the balance thresholds), "
                            "round_robin, least_loaded (default: %(default)s)")
    group.add_argument("--cache-threshold", type=float, default=0.5,
                       help="cache_aware: the share of the prompt a worker must have been sent before "
                            "for a cache hit (default: %(default)s)")
    group.add_argument("--balance-abs-threshold", type=int, default=8,
                       help="cache_aware: a worker with more than this many requests in flight above the "
                            "least loaded one (and --balance-rel-threshold times its load) gets no more "
                            "(default: %(default)s)")
    group.add_argument("--balance-rel-threshold", type=float, default=1.5,
                       help="cache_aware: see --balance-abs-threshold (default: %(default)s)")
    group.add_argument("--max-tree-chars", type=int, default=1_000_000,
                       help="cache_aware: characters of routed prompts remembered per worker, least "
                            "recently used forgotten first (default: %(default)s)")
    group.add_argument("--health-interval", type=float, default=2.0,
                       help="seconds between health checks of each worker (default: %(default)s)")


def add_data_parallel_args(serve: argparse.ArgumentParser) -> None:
    """``kvloom serve --data-parallel-size N`` and the routing flags, on the serve parser
    (kvloom/cli.py calls this: the server below knows nothing of the router). With N > 1
    the command starts N engines and a router instead of serving (kvloom/router/launch.py)."""
    serve_one = serve.get_default("run")
    parallel = serve.add_argument_group("data parallel (kvloom/router)")
    parallel.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                          help="start this many engines (each its own `kvloom serve` process on a free "
                               "loopback port) behind a cache-aware router on --host/--port")
    parallel.add_argument("--startup-timeout", type=float, default=600.0,
                          help="with --data-parallel-size: seconds for every engine to load its model "
                               "(default: %(default)s)")
    add_policy_args(parallel, policy_flag="--router-policy")

    def run(args: argparse.Namespace) -> int:
        # `--role` is an engine flag (prefill, decode, both); its launcher value is ours.
        if getattr(args, "role", None) == DISAGGREGATED:
            return _run_disaggregated(args, serve)
        if args.data_parallel_size == 1:
            return int(serve_one(args))
        return _run_data_parallel(args, serve)

    serve.set_defaults(run=run)


DISAGGREGATED = "disaggregated"  # `kvloom serve --role disaggregated`: kvloom/router/launch.py


def _run_data_parallel(args: argparse.Namespace, serve: argparse.ArgumentParser) -> int:
    if args.data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {args.data_parallel_size}")
    argv = _own_command_line(args, serve, "--data-parallel-size N")
    from kvloom.router.launch import run_data_parallel
    return run_data_parallel(args, argv, lambda urls: router_config(args, urls))


def _run_disaggregated(args: argparse.Namespace, serve: argparse.ArgumentParser) -> int:
    if args.data_parallel_size != 1:
        raise ValueError(f"--role {DISAGGREGATED} starts one prefill and one decode engine behind a router; "
                         f"it cannot be combined with --data-parallel-size {args.data_parallel_size}")
    argv = _own_command_line(args, serve, f"--role {DISAGGREGATED}")
    from kvloom.router.launch import run_disaggregated
    return run_disaggregated(args, argv, lambda prefill, decode: router_config(args, (), prefill, decode))


def _own_command_line(args: argparse.Namespace, serve: argparse.ArgumentParser, flag: str) -> list[str]:
    """This command's arguments after ``serve``: the workers run this very command line
    minus the router's flags. It is read back from ``sys.argv`` and must parse to
    ``args`` (else the command was not ours: ValueError)."""
    argv = sys.argv[1:]
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    again = _parse_quietly(serve, argv)
    if not again or any(again.get(key, object()) != value for key, value in vars(args).items()
                        if key in again and key != "run"):
        raise ValueError(f"{flag.split()[0]} starts each engine with this process's command line; "
                         f"run it as a command (`kvloom serve ... {flag}`)")
    return argv


def _parse_quietly(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, object]:
    """``parser``'s parse of ``argv``, or {} where it would print usage and exit."""
    import contextlib
    import io

    with contextlib.redirect_stderr(io.StringIO()):
        try:
            return vars(parser.parse_args(argv))
        except SystemExit:
            return {}


def add_router_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``router --worker URL [--worker URL ...] --host --port --policy ...``, or
    instead of the workers ``--prefill URL ... --decode URL ...`` (disaggregation)."""
    router = subparsers.add_parser("router", allow_abbrev=False,
                                   help="OpenAI-compatible router in front of kvloom servers "
                                        "(data parallelism; prefill/decode disaggregation)")
    group = router.add_argument_group("router")
    group.add_argument("--worker", action="append", default=[], metavar="URL",
                       help="a kvloom server's base URL, http://HOST:PORT (repeatable)")
    group.add_argument("--prefill", action="append", default=[], metavar="URL",
                       help="instead of --worker: a `kvloom serve --role prefill` instance (repeatable; "
                            "with --decode): each request's prompt is computed there, its KV sent on "
                            "to a decode instance")
    group.add_argument("--decode", action="append", default=[], metavar="URL",
                       help="instead of --worker: a `kvloom serve --role decode` instance (repeatable; "
                            "with --prefill): generates the tokens from the prefill's KV")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    group.add_argument("--port", type=port_number, default=8000, help="port to listen on (default: %(default)s)")
    group.add_argument("--api-key", default=os.environ.get("KVLOOM_API_KEY"),
                       help="the workers' API key, for the router's own calls (default: $KVLOOM_API_KEY); "
                            "clients' Authorization headers are passed through to the workers")
    group.add_argument("--startup-timeout", type=float, default=60.0,
                       help="seconds for every worker to answer at start (default: %(default)s)")
    group.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"],
                       help="log level (default: %(default)s)")
    add_policy_args(group)
    add_cors_args(router)
    router.set_defaults(run=run_router_command)


def router_config(args: argparse.Namespace, workers: Sequence[str], prefill: Sequence[str] = (),
                  decode: Sequence[str] = ()) -> RouterConfig:
    """The ``RouterConfig`` of the parsed flags (ValueError naming a bad one)."""
    from kvloom.router.config import RouterConfig
    from kvloom.router.policy import PolicyConfig

    policy = PolicyConfig(cache_threshold=args.cache_threshold, balance_abs_threshold=args.balance_abs_threshold,
                          balance_rel_threshold=args.balance_rel_threshold, max_tree_chars=args.max_tree_chars)
    return RouterConfig(tuple(workers), policy=args.router_policy, policy_config=policy,
                        health_interval=args.health_interval, startup_timeout=args.startup_timeout,
                        api_key=args.api_key, prefill=tuple(prefill), decode=tuple(decode),
                        cors=cors_settings(args))


def run_router_command(args: argparse.Namespace) -> int:
    from kvloom.router.main import configure_logging, run_router

    config = router_config(args, args.worker, args.prefill, args.decode)
    configure_logging(args.log_level)
    what = (f"{len(config.prefill)} prefill and {len(config.decode)} decode instance(s)" if config.disaggregated
            else f"{len(config.workers)} worker(s)")
    print(f"kvloom router: checking {what}...", file=sys.stderr)
    return run_router(config, host=args.host, port=args.port, log_level=args.log_level)
