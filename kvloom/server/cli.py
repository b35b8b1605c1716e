"""`kvloom serve`: argument parsing only; the work is in ``run_server``."""

from __future__ import annotations

import argparse
import json
import os
import ssl

from kvloom.engine_args import add_engine_args, add_version_flag, engine_kwargs, lora_module, port_number
from kvloom.server.reasoning_parsers import REASONING_PARSERS
from kvloom.server.settings import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_WAITING,
    STATS_LOG_INTERVAL,
    ConnectionLimits,
    CorsSettings,
    ServerSettings,
)
from kvloom.server.tool_parsers import DEFAULT_FORCED_FORMAT, TOOL_PARSERS
from kvloom.structured.tool_grammar import TOOL_STRICT_LEVELS


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``serve [MODEL] --host --port --api-key --max-waiting ...`` plus the engine
    flags; returns it (kvloom/cli.py adds the data-parallel flags, kvloom/router/cli.py)."""
    serve = subparsers.add_parser("serve", allow_abbrev=False, help="OpenAI-compatible HTTP server")
    add_version_flag(serve)
    add_engine_args(serve)
    group = serve.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    group.add_argument("--port", type=port_number, default=8000, help="port to listen on (default: %(default)s)")
    group.add_argument("--api-key", default=os.environ.get("KVLOOM_API_KEY"),
                       help="require 'Authorization: Bearer KEY' (default: $KVLOOM_API_KEY; "
                            "/health, /version and /metrics stay open)")
    group.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                       help="requests allowed to wait for admission; beyond it: 503")
    group.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help="largest request body; beyond it: 413")
    group.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the model ids clients may use, the first one reported in responses "
                            "and /v1/models (default: the MODEL argument)")
    group.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"],
                       help="server log level (default: %(default)s)")
    group.add_argument("--disable-log-stats", action="store_true",
                       help=f"no periodic stats line (throughput, running/waiting, KV usage, "
                            f"prefix-cache hits; every {STATS_LOG_INTERVAL:g} s while busy)")
    group.add_argument("--disable-dashboard", action="store_true",
                       help="do not serve the live dashboard at /dashboard (and its data at /dashboard/data, "
                            "/dashboard/events); it follows the same API-key rule as /metrics")
    group.add_argument("--profiler-dir", default=os.environ.get("VLLM_TORCH_PROFILER_DIR") or None, metavar="DIR",
                       help="serve POST /start_profile and /stop_profile: the torch profiler records the engine's "
                            "steps between them, written to DIR as a Chrome trace for Perfetto (default: "
                            "$VLLM_TORCH_PROFILER_DIR; none: no profiling endpoints)")
    group.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="send an OpenTelemetry span per request (queued, scheduled, first token, "
                            "preemptions, finish; token counts) to this OTLP/HTTP traces URL, "
                            "e.g. http://localhost:4318/v1/traces (default: no tracing)")
    group.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH", type=lora_module,
                       help="LoRA adapters to serve beside the model (needs --enable-lora): a request's "
                            "\"model\" names one; PATH is a PEFT adapter directory")
    group.add_argument("--allow-runtime-lora-updating", action="store_true",
                       default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
                       help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora; "
                            "default: vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    tools = serve.add_argument_group("tool calling")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="with tool_choice \"auto\" (the default when a request has tools), parse "
                            "the model's output into tool_calls (needs --tool-call-parser)")
    tools.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                       help="the model's tool-call format: hermes (SmolLM2, Qwen), llama3_json, mistral; "
                            f"forced calls (tool_choice \"required\" or a named function) are written in "
                            f"it too (default for those: {DEFAULT_FORCED_FORMAT})")
    tools.add_argument("--tool-strict-level", choices=TOOL_STRICT_LEVELS, default="auto",
                       help="what tool_choice \"auto\" holds to the format (vLLM's): auto, calls of a request "
                            "with a \"strict\" tool (their envelope; a strict tool's arguments to its schema); "
                            "function, every request's calls' envelope; parameter, also every tool's arguments")
    tools.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                       help="a thinking model's format (<think>...</think>): chat completions carry the "
                            "reasoning as \"reasoning\" beside the content (the model must have both markers "
                            "as tokens)")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="let a chat request bring its own chat_template (sandboxed Jinja; off by default, "
                            "as vLLM's)")
    responses = serve.add_argument_group("what responses carry and what is logged (vLLM's flags)")
    responses.add_argument("--enable-force-include-usage", action="store_true",
                           help="end every stream with its usage chunk, whether or not the request asked "
                                "(stream_options.include_usage)")
    responses.add_argument("--return-tokens-as-token-ids", action="store_true",
                           help="logprobs name every token \"token_id:<id>\" (a request can ask for it itself)")
    responses.add_argument("--response-role", default="assistant",
                           help="the role of a chat reply where the prompt opens a new turn (default: %(default)s)")
    responses.add_argument("--enable-request-id-headers", action="store_true",
                           help="every response carries X-Request-Id: the request's own header's, else a fresh id")
    responses.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                           help="serve GET /tokenizer_info: the tokenizer's tokenizer_config.json (special tokens, "
                                "added tokens, chat template), as vLLM's")
    responses.add_argument("--enable-responses-store", action="store_true",
                           default=os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "").lower() in ("1", "true"),
                           help="the Responses API stores responses (store, true by default as OpenAI's): GET and "
                                "DELETE /v1/responses/{id}, previous_response_id; in memory, the last 10,000 "
                                "(default: vLLM's VLLM_ENABLE_RESPONSES_API_STORE)")
    responses.add_argument("--enable-log-requests", action="store_true", dest="log_requests",
                           help="log every generation request: its ids, prompt token ids and parameters")
    responses.add_argument("--disable-log-requests", action="store_false", dest="log_requests",
                           help="do not log them (the default; vLLM's older flag)")
    responses.add_argument("--max-log-len", type=int, default=None, metavar="N",
                           help="log at most N prompt token ids a request (default: all)")
    responses.add_argument("--enable-server-load-tracking", action="store_true",
                           help="accepted for vLLM command lines; changes nothing: GET /load always counts the "
                                "requests being answered here")
    responses.add_argument("--enable-prompt-tokens-details", action="store_true",
                           help="accepted for vLLM command lines; changes nothing: usage always carries "
                                "prompt_tokens_details.cached_tokens here")
    add_cors_args(serve)
    http = serve.add_argument_group("HTTP server (vLLM's uvicorn flags)")
    http.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the private key file (PEM)")
    http.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate file (PEM)")
    http.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify clients' certificates with")
    http.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                      help="whether clients must present a certificate (Python's ssl.CERT_*: 0 none, 1 optional, "
                           "2 required; default 0)")
    http.add_argument("--root-path", default=None,
                      help="the path prefix a reverse proxy serves the API under (its OpenAPI page names it)")
    http.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")
    http.add_argument("--uvicorn-log-level", default=None,
                      choices=["critical", "error", "warning", "info", "debug", "trace"],
                      help="uvicorn's own log level (default: --log-level)")
    http.add_argument("--trust-remote-code", action="store_true",
                      help="accepted for vLLM command lines; changes nothing: kvloom runs its own model code, "
                           "never a checkpoint's")
    limits = ConnectionLimits()
    group.add_argument("--header-timeout", type=float, default=limits.header_timeout,
                       help="seconds a connection has to send complete request headers; then it is closed")
    group.add_argument("--body-timeout", type=float, default=limits.body_timeout,
                       help="seconds a request has to send its whole body once its headers are in; "
                            "then the connection is closed")
    group.add_argument("--max-header-bytes", type=int, default=limits.max_header_bytes,
                       help="largest request header block; beyond it: 431")
    group.add_argument("--max-connections", type=int, default=limits.max_connections,
                       help="open connections served at once; beyond it new requests get 503")
    serve.set_defaults(run=run_serve)
    return serve


def add_cors_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's CORS flags (``kvloom serve`` and ``kvloom router``); ``cors_settings`` reads them."""
    cors = parser.add_argument_group("CORS (vLLM's flags: JSON lists)")
    cors.add_argument("--allowed-origins", type=_json_list, default=["*"],
                      help='origins browsers may call the API from (default: ["*"])')
    cors.add_argument("--allowed-methods", type=_json_list, default=["*"], help='default: ["*"]')
    cors.add_argument("--allowed-headers", type=_json_list, default=["*"], help='default: ["*"]')
    cors.add_argument("--allow-credentials", action="store_true",
                      help="let browsers send cookies and credentials cross-origin")


def cors_settings(args: argparse.Namespace) -> CorsSettings:
    return CorsSettings(tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                        args.allow_credentials)


def http_options(args: argparse.Namespace) -> dict[str, object]:
    """uvicorn's options of the HTTP flags: TLS (both files or neither), the root path,
    the access log and uvicorn's log level."""
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise SystemExit("kvloom serve: error: --ssl-keyfile and --ssl-certfile go together (HTTPS needs both)")
    options: dict[str, object] = {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile,
                                  "ssl_ca_certs": args.ssl_ca_certs, "ssl_cert_reqs": args.ssl_cert_reqs,
                                  "access_log": not args.disable_uvicorn_access_log}
    if args.root_path is not None:
        options["root_path"] = args.root_path
    if args.uvicorn_log_level is not None:
        options["log_level"] = args.uvicorn_log_level
    return options


def _json_list(text: str) -> list[str]:
    try:
        values = json.loads(text)
    except json.JSONDecodeError:
        values = None
    if not isinstance(values, list) or not all(isinstance(value, str) for value in values):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
    return values



def server_settings(args: argparse.Namespace) -> ServerSettings:
    """The HTTP layer's settings from ``kvloom serve``'s flags."""
    names = args.served_model_name or [None]
    return ServerSettings(served_model_name=names[0], model_aliases=tuple(names[1:]), api_key=args.api_key,
                          max_body_bytes=args.max_body_bytes, tool_call_parser=args.tool_call_parser,
                          enable_auto_tool_choice=args.enable_auto_tool_choice,
                          tool_strict_level=args.tool_strict_level,
                          reasoning_parser=args.reasoning_parser,
                          trust_request_chat_template=args.trust_request_chat_template,
                          enable_dashboard=not args.disable_dashboard,
                          otlp_traces_endpoint=args.otlp_traces_endpoint, lora_modules=tuple(args.lora_modules),
                          allow_runtime_lora_updating=args.allow_runtime_lora_updating, cors=cors_settings(args),
                          force_include_usage=args.enable_force_include_usage,
                          return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                          response_role=args.response_role, enable_request_id_headers=args.enable_request_id_headers,
                          log_requests=args.log_requests, max_log_len=args.max_log_len,
                          enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                          enable_responses_store=args.enable_responses_store, profiler_dir=args.profiler_dir)


def run_serve(args: argparse.Namespace) -> int:
    from kvloom.server.main import run_server

    return run_server(args.model, engine_kwargs(args), server_settings(args), host=args.host, port=args.port,
                      max_waiting=args.max_waiting, log_stats=not args.disable_log_stats, log_level=args.log_level,
                      http_options=http_options(args),
                      limits=ConnectionLimits(header_timeout=args.header_timeout,
                                              body_timeout=args.body_timeout,
                                              max_header_bytes=args.max_header_bytes,
                                              max_connections=args.max_connections))
