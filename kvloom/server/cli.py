"""`kvloom serve`: argument parsing only; the work is in ``run_server``."""

from __future__ import annotations

import argparse
import os

from kvloom.engine_args import add_engine_args, engine_kwargs
from kvloom.server.settings import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING, ConnectionLimits


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``serve [MODEL] --host --port --api-key --max-waiting ...`` plus the engine flags."""
    serve = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    group = serve.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--api-key", default=os.environ.get("KVLOOM_API_KEY"),
                       help="require 'Authorization: Bearer KEY' (default: $KVLOOM_API_KEY; "
                            "/health, /version and /metrics stay open)")
    group.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                       help="requests allowed to wait for admission; beyond it: 503")
    group.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help="largest request body; beyond it: 413")
    group.add_argument("--served-model-name", default=None,
                       help="the model id clients use (default: the MODEL argument)")
    group.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    limits = ConnectionLimits()
    group.add_argument("--header-timeout", type=float, default=limits.header_timeout,
                       help="seconds a connection has to send complete request headers; then it is closed")
    group.add_argument("--max-header-bytes", type=int, default=limits.max_header_bytes,
                       help="largest request header block; beyond it: 431")
    group.add_argument("--max-connections", type=int, default=limits.max_connections,
                       help="open connections served at once; beyond it new requests get 503")
    serve.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from kvloom.server.main import run_server

    return run_server(args.model, engine_kwargs(args), host=args.host, port=args.port,
                      api_key=args.api_key, max_waiting=args.max_waiting,
                      max_body_bytes=args.max_body_bytes,
                      served_model_name=args.served_model_name, log_level=args.log_level,
                      limits=ConnectionLimits(header_timeout=args.header_timeout,
                                              max_header_bytes=args.max_header_bytes,
                                              max_connections=args.max_connections))
