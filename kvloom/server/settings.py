"""Server settings: what the HTTP layer needs beyond the engine's own configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvloom.lora.request import LoRARequest  # checks --lora-modules' names and paths
from kvloom.structured.tool_grammar import TOOL_STRICT_LEVELS

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_WAITING = 1024
STATS_LOG_INTERVAL = 5.0  # seconds between two stats lines while the engine is busy


@dataclass(frozen=True)
class CorsSettings:
    """CORS, as vLLM's flags and defaults: browsers may call the API from any origin
    unless ``allowed_origins`` narrows it (Starlette's CORSMiddleware answers the
    preflights; server/middleware.py ``install_cors``). The server's and the router's."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            values = getattr(self, name)
            if not isinstance(values, tuple) or not all(isinstance(value, str) and value for value in values):
                raise ValueError(f"{name} must be a list of non-empty strings, got {values!r}")


@dataclass(frozen=True)
class ServerSettings:
    """``served_model_name`` is the id clients see in ``/v1/models`` (default: the model
    argument as given). ``model_aliases`` are further ids accepted in the ``model``
    field, e.g. the model path next to a short served name."""

    served_model_name: str | None = None
    model_aliases: tuple[str, ...] = ()
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Largest n (samples per prompt) one request may ask for.
    max_n: int = 128
    # Tool calling (vLLM's flags): the model's tool-call format (server/tool_parsers.py),
    # and whether tool_choice "auto" parses the output with it.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # vLLM's --tool-strict-level: what tool_choice "auto" holds to the format
    # (structured/tool_grammar.py TOOL_STRICT_LEVELS): "auto", the tools' own "strict".
    tool_strict_level: str = "auto"
    # vLLM's --reasoning-parser: a thinking model's output split into reasoning and
    # content in chat completions (server/reasoning_parsers.py).
    reasoning_parser: str | None = None
    # vLLM's --trust-request-chat-template: a request may bring its own chat template
    # (sandboxed Jinja, but code the server runs: off unless asked for).
    trust_request_chat_template: bool = False
    # The live dashboard at /dashboard (server/dashboard.py), on unless disabled.
    enable_dashboard: bool = True
    # OpenTelemetry: an OTLP/HTTP collector's traces URL (e.g. http://host:4318/v1/traces)
    # that receives a span per request (server/tracing.py); None: no tracing.
    otlp_traces_endpoint: str | None = None
    # LoRA adapters served beside the model (vLLM's --lora-modules): (name, PEFT directory)
    # each; a request names one in its ``model`` field. The engine needs enable_lora.
    lora_modules: tuple[tuple[str, str], ...] = ()
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: POST /v1/load_lora_adapter and
    # /v1/unload_lora_adapter add and remove adapters while serving.
    allow_runtime_lora_updating: bool = False
    cors: CorsSettings = field(default_factory=CorsSettings)
    # vLLM's switches for what responses carry and what is logged:
    # --enable-force-include-usage: every stream ends with its usage chunk, asked for or not;
    force_include_usage: bool = False
    # --return-tokens-as-token-ids: every request's logprobs name tokens "token_id:<id>";
    return_tokens_as_token_ids: bool = False
    # --response-role: the role of a chat reply's message where a new turn is opened
    # (add_generation_prompt; a continued message keeps its own role);
    response_role: str = "assistant"
    # --enable-request-id-headers: every response carries X-Request-Id (the request's own
    # header's value, else a fresh id);
    enable_request_id_headers: bool = False
    # --enable-tokenizer-info-endpoint: GET /tokenizer_info serves the tokenizer's config.
    enable_tokenizer_info_endpoint: bool = False
    # --enable-responses-store (vLLM's VLLM_ENABLE_RESPONSES_API_STORE): the Responses API
    # keeps stored responses (server/response_store.py): GET /v1/responses/{id},
    # previous_response_id.
    enable_responses_store: bool = False
    # --enable-log-requests: a log line per generation request (its engine requests' ids,
    # prompt token ids, at most max_log_len of them, and parameters).
    log_requests: bool = False
    max_log_len: int | None = None
    # --profiler-dir (vLLM's VLLM_TORCH_PROFILER_DIR): POST /start_profile and /stop_profile
    # run the torch profiler over the engine's steps, its traces written here.
    profiler_dir: str | None = None

    def __post_init__(self) -> None:
        from kvloom.server.reasoning_parsers import get_reasoning_parser
        from kvloom.server.tool_parsers import get_tool_parser

        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # ValueError naming tool_call_parser
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)  # ValueError naming reasoning_parser
        if self.tool_call_parser == "openai" and self.reasoning_parser != "openai_gptoss":
            raise ValueError("tool_call_parser 'openai' reads GPT-OSS's harmony messages: it needs "
                             "reasoning_parser 'openai_gptoss', which takes them apart from its analysis channel")
        if self.tool_strict_level not in TOOL_STRICT_LEVELS:
            raise ValueError(f"tool_strict_level must be one of {', '.join(TOOL_STRICT_LEVELS)}, "
                             f"got {self.tool_strict_level!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (the format to parse "
                             "the model's calls in)")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be a positive integer, got {self.max_body_bytes!r}")
        if not isinstance(self.response_role, str) or not self.response_role:
            raise ValueError(f"response_role must be a non-empty string, got {self.response_role!r}")
        if self.max_log_len is not None and (isinstance(self.max_log_len, bool) or not isinstance(self.max_log_len, int)
                                             or self.max_log_len < 0):
            raise ValueError(f"max_log_len must be an integer >= 0, got {self.max_log_len!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (omit it to disable authentication)")
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names must be unique, got {names}")
        for index, (name, path) in enumerate(self.lora_modules, start=1):
            LoRARequest(name, index, path)  # ValueError naming a bad name or path

    def model_ids(self, engine_model_name: str) -> tuple[str, ...]:
        """Accepted ``model`` values, the served name first."""
        names = (self.served_model_name or engine_model_name, engine_model_name, *self.model_aliases)
        return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class ConnectionLimits:
    """Per-connection guards of the HTTP server (server/http_protocol.py): seconds to
    send complete request headers, then seconds to send the whole body, the largest
    header block (431 beyond), open connections served at once (503 beyond), seconds an
    idle keep-alive connection stays open."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_header_bytes: int = 16 * 1024
    max_connections: int = 2048
    keep_alive_timeout: float = 5.0

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout", "max_header_bytes", "max_connections",
                     "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
