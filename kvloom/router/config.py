"""``RouterConfig``: everything the router needs, validated once, with messages that name
the field."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvloom.router.policy import POLICIES, PolicyConfig
from kvloom.server.settings import DEFAULT_MAX_BODY_BYTES, CorsSettings


@dataclass(frozen=True)
class RouterConfig:
    """``workers``: the kvloom servers' base URLs (``http://host:port``), in order.
    ``prefill`` and ``decode`` (prefill/decode disaggregation, kvloom/router/disagg.py):
    the instances started with ``--role prefill`` and ``--role decode``, given instead of
    ``workers``, which then holds both pools (prefill first).
    ``api_key``: sent to workers on the router's own calls (the startup check, health);
    clients' ``Authorization`` headers are passed through, so workers keep checking them.
    ``cors``: who may call the router from a browser (the server's flags and defaults)."""

    workers: tuple[str, ...] = ()
    policy: str = "cache_aware"
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    health_interval: float = 2.0  # seconds between two health checks of each worker
    health_timeout: float = 5.0  # seconds a health check may take
    health_failures: int = 2  # consecutive failed checks (other than a refused connection) -> down
    startup_timeout: float = 60.0  # seconds for every worker to answer /v1/models at start
    connect_timeout: float = 5.0
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    cors: CorsSettings = field(default_factory=CorsSettings)

    @property
    def worker_headers(self) -> dict[str, str]:
        """The headers of the router's own calls to workers: ``api_key`` as a bearer token."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode pools (``prefill``/``decode``) instead of one pool of workers."""
        return bool(self.decode)

    def __post_init__(self) -> None:
        if self.prefill or self.decode:
            self._pools()
        if not self.workers:
            raise ValueError("workers: give at least one worker URL (--worker http://HOST:PORT), or "
                             "prefill and decode instances (--prefill URL --decode URL)")
        normalized = tuple(_normalize_url(url) for url in self.workers)
        duplicates = sorted({u for u in normalized if normalized.count(u) > 1})
        if duplicates:
            raise ValueError(f"workers: {duplicates[0]} is given more than once")
        object.__setattr__(self, "workers", normalized)
        if self.decode:
            object.__setattr__(self, "prefill", normalized[:len(self.prefill)])
            object.__setattr__(self, "decode", normalized[len(self.prefill):])
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        for name in ("health_interval", "health_timeout", "startup_timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.health_failures < 1:
            raise ValueError(f"health_failures must be >= 1, got {self.health_failures}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (omit it)")

    def _pools(self) -> None:
        """Disaggregated: both pools given, no ``workers``; ``workers`` becomes both."""
        if self.workers:
            raise ValueError("workers: --worker cannot be combined with --prefill/--decode; give either "
                             "--worker URL ... (data parallel) or --prefill URL ... --decode URL ... "
                             "(prefill/decode disaggregation)")
        if not self.decode:
            raise ValueError("decode: --prefill needs at least one --decode URL (an instance started "
                             "with --role decode, which generates the tokens)")
        if not self.prefill:
            raise ValueError("prefill: --decode needs at least one --prefill URL (an instance started "
                             "with --role prefill); for instances that do both, use --worker")
        object.__setattr__(self, "workers", (*self.prefill, *self.decode))


def _normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` -> ``http://host:port``."""
    text = url.strip().rstrip("/")
    if "://" not in text:
        text = f"http://{text}"
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"workers: {url!r} is not a worker URL (http://HOST:PORT)")
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        raise ValueError(f"workers: {url!r} has a bad port") from None
    if parts.path or parts.query:
        raise ValueError(f"workers: {url!r} must be a base URL without a path (http://HOST:PORT)")
    return text
