"""Serving-benchmark metrics, defined as vLLM's ``benchmark_serving`` defines them.

Per successful request (times in seconds on the client's clock, from sending it):

- TTFT: until the first streamed chunk that carries generated text.
- ITL: the gaps between consecutive text-carrying chunks (a chunk holding several
  tokens is one gap, as in vLLM).
- TPOT: ``(e2e - ttft) / (output_tokens - 1)``, only for requests with > 1 token.
- E2EL: until the stream ended.

Over the run (``duration``: first send to last completion): request throughput
= completed / duration; output token throughput = output tokens / duration; total
token throughput adds the prompt tokens. Prompt tokens are the dataset's counts
(the same for every engine compared), output tokens the server's ``usage``.
Goodput = requests meeting every SLO / duration, with vLLM's convention that a
one-token request's TPOT is 0. Failed requests count only in ``failed``.

Distributions are reported in milliseconds: mean, median, std (population), p90,
p99, with numpy's default linear interpolation for percentiles.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "BenchMetrics", "Distribution", "RequestRecord", "compute_metrics", "counter_deltas",
    "format_report", "meets_slo", "parse_prometheus", "parse_slo", "percentile",
]

# Engines whose /metrics counters the report picks up, and the counters that matter.
ENGINE_METRIC_PREFIXES = ("kvloom:", "vllm:", "sglang:")
COUNTER_KEYWORDS = ("prefix_cache_hits", "prefix_cache_queries", "preempt", "retract",
                    "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                    "spec_decode_num_accepted_tokens")
SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass(slots=True)
class RequestRecord:
    """What the client observed for one request; ``error`` is None on success."""

    index: int
    prompt_len: int  # the dataset's count (client tokenizer, no template)
    output_len: int = 0  # usage.completion_tokens, else the text-carrying chunks
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None  # on failure: until the failure
    error: str | None = None
    start_time: float = 0.0  # seconds after the benchmark started
    server_prompt_tokens: int | None = None  # usage.prompt_tokens (template and BOS included)
    usage_reported: bool = False
    group: int | None = None
    turn: int | None = None

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first; None below two tokens."""
        if self.output_len <= 1 or self.e2e is None or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Distribution:
    """Summary of a sample in milliseconds; all zero when ``count`` is 0 (vLLM's convention)."""

    count: int
    mean: float
    median: float
    std: float
    p90: float
    p99: float

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Distribution:
        ms = sorted(v * 1000.0 for v in values)
        if not ms:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        mean = math.fsum(ms) / len(ms)
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in ms) / len(ms))
        return cls(len(ms), mean, percentile(ms, 50), std, percentile(ms, 90), percentile(ms, 99))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation between closest ranks
    (numpy's default): rank ``(n - 1) * q / 100`` in the sorted values."""
    if not values:
        raise ValueError("percentile of an empty sample")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft:500,tpot:50"`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    if not text:
        return {}
    slo: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition(":")
        key = "e2el" if key == "e2e" else key
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo: expected KEY:MS with KEY in {SLO_KEYS}, got {part!r}")
        try:
            slo[key] = float(value)
        except ValueError:
            raise ValueError(f"--slo: {key} needs a number of milliseconds, got {value!r}") from None
        if not slo[key] > 0:
            raise ValueError(f"--slo: {key} must be > 0 ms, got {value}")
    return slo


def meets_slo(record: RequestRecord, slo: Mapping[str, float]) -> bool:
    """Whether a successful request meets every SLO (milliseconds)."""
    if not record.success or record.ttft is None or record.e2e is None:
        return False
    observed = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2e}
    return all(observed[key] * 1000.0 <= limit for key, limit in slo.items())


@dataclass(frozen=True)
class BenchMetrics:
    """The run's aggregate numbers (throughputs per second, latencies in ms)."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    server_input_tokens: int | None  # sum of usage.prompt_tokens, when every success had usage
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None  # None without SLOs
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    ttft_ms_by_turn: dict[int, Distribution] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  # message -> count

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BenchMetrics:
        """Inverse of ``to_json`` (JSON turns the per-turn keys into strings)."""
        values: dict[str, Any] = dict(data)
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            values[key] = Distribution(**data[key])
        values["ttft_ms_by_turn"] = {int(turn): Distribution(**d)
                                     for turn, d in data.get("ttft_ms_by_turn", {}).items()}
        return cls(**values)


def compute_metrics(records: Sequence[RequestRecord], duration_s: float,
                    slo: Mapping[str, float] | None = None) -> BenchMetrics:
    """Aggregate ``records`` of a run that lasted ``duration_s`` seconds."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in records if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    # Only a full count is meaningful: one missing usage would make the sum a lower bound.
    server_counts = [r.server_prompt_tokens for r in ok]
    server_input = (sum(c for c in server_counts if c is not None)
                    if server_counts and None not in server_counts else None)
    by_turn: dict[int, list[float]] = {}
    for r in ok:
        if r.turn is not None and r.ttft is not None:
            by_turn.setdefault(r.turn, []).append(r.ttft)
    return BenchMetrics(
        completed=len(ok), failed=len(records) - len(ok), duration_s=duration_s,
        total_input_tokens=input_tokens, total_output_tokens=output_tokens,
        server_input_tokens=server_input,
        request_throughput=len(ok) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        goodput=(sum(meets_slo(r, slo) for r in ok) / duration_s) if slo else None,
        ttft_ms=Distribution.of_seconds([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=Distribution.of_seconds([t for r in ok if (t := r.tpot) is not None]),
        itl_ms=Distribution.of_seconds([gap for r in ok for gap in r.itl]),
        e2el_ms=Distribution.of_seconds([r.e2e for r in ok if r.e2e is not None]),
        ttft_ms_by_turn={turn: Distribution.of_seconds(v) for turn, v in sorted(by_turn.items())},
        errors=dict(Counter(r.error for r in records if r.error is not None).most_common()),
    )


# ---------------------------------------------------------------- server counters
def _split_sample(line: str) -> tuple[str, str] | None:
    """``name{labels} value [ts]`` -> (name, value text); label values may hold
    spaces, braces and escaped quotes, so the label set is scanned, not split."""
    brace = line.find("{")
    space = line.find(" ")
    if brace == -1 or (space != -1 and space < brace):
        name, _, rest = line.partition(" ")
        return (name, rest) if rest else None
    position, quoted = brace + 1, False
    while position < len(line):
        char = line[position]
        if quoted and char == "\\":
            position += 2
            continue
        if char == '"':
            quoted = not quoted
        elif char == "}" and not quoted:
            return line[:brace], line[position + 1:]
        position += 1
    return None


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> sample name -> value summed over label sets.
    Malformed lines are skipped: a report should not die on a server's odd metric."""
    totals: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = _split_sample(line)
        if parts is None:
            continue
        name, rest = parts
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        totals[name] = totals.get(name, 0.0) + value
    return totals


def _is_tracked_counter(name: str) -> bool:
    return (name.startswith(ENGINE_METRIC_PREFIXES) and not name.endswith("_created")
            and any(keyword in name for keyword in COUNTER_KEYWORDS))


def counter_deltas(before: Mapping[str, float] | None,
                   after: Mapping[str, float] | None) -> dict[str, float]:
    """Deltas of the prefix-cache, preemption and speculative-decoding counters over a
    run, plus ``<prefix>prefix_cache_hit_rate`` (hits / queries) where queries grew,
    and ``<prefix>spec_decode_acceptance_rate`` (accepted / draft tokens) and
    ``<prefix>spec_decode_mean_accepted_length`` (1 + accepted / verifications) where
    drafts were verified. Empty when either scrape is missing (the server has no
    /metrics)."""
    if before is None or after is None:
        return {}
    # A counter reset (server restarted mid-run) or a NaN sample gives no usable delta.
    deltas = {name: delta for name, value in sorted(after.items()) if _is_tracked_counter(name)
              if math.isfinite(delta := value - before.get(name, 0.0)) and delta >= 0}
    for prefix in ENGINE_METRIC_PREFIXES:
        hits = sum(v for k, v in deltas.items() if k.startswith(prefix) and "prefix_cache_hits" in k)
        queries = sum(v for k, v in deltas.items()
                      if k.startswith(prefix) and "prefix_cache_queries" in k)
        if queries > 0:
            deltas[f"{prefix}prefix_cache_hit_rate"] = hits / queries
        drafts = _summed(deltas, prefix, "spec_decode_num_drafts")
        draft_tokens = _summed(deltas, prefix, "spec_decode_num_draft_tokens")
        accepted = _summed(deltas, prefix, "spec_decode_num_accepted_tokens")
        if draft_tokens > 0:
            deltas[f"{prefix}spec_decode_acceptance_rate"] = accepted / draft_tokens
        if drafts > 0:
            deltas[f"{prefix}spec_decode_mean_accepted_length"] = 1.0 + accepted / drafts
    return deltas


def _summed(deltas: Mapping[str, float], prefix: str, name: str) -> float:
    """The delta of counter ``<prefix><name>`` (``_total`` and labelled series summed)."""
    return sum(v for k, v in deltas.items()
               if k.startswith(prefix) and k[len(prefix):].removesuffix("_total").split("{")[0] == name)


# ---------------------------------------------------------------- report
def _rows(metrics: BenchMetrics) -> Iterable[tuple[str, str]]:
    yield "Successful requests:", f"{metrics.completed}"
    yield "Failed requests:", f"{metrics.failed}"
    yield "Benchmark duration (s):", f"{metrics.duration_s:.2f}"
    yield "Total input tokens:", f"{metrics.total_input_tokens}"
    yield "Total generated tokens:", f"{metrics.total_output_tokens}"
    yield "Request throughput (req/s):", f"{metrics.request_throughput:.2f}"
    if metrics.goodput is not None:
        yield "Request goodput (req/s):", f"{metrics.goodput:.2f}"
    yield "Output token throughput (tok/s):", f"{metrics.output_throughput:.2f}"
    yield "Total token throughput (tok/s):", f"{metrics.total_token_throughput:.2f}"
    for title, acronym, dist in (
            ("Time to First Token", "TTFT", metrics.ttft_ms),
            ("Time per Output Token (excl. 1st token)", "TPOT", metrics.tpot_ms),
            ("Inter-token Latency", "ITL", metrics.itl_ms),
            ("End-to-end Latency", "E2EL", metrics.e2el_ms)):
        yield f"-{title}-", ""
        for stat, name in (("mean", "Mean"), ("median", "Median"), ("std", "Std"),
                           ("p90", "P90"), ("p99", "P99")):
            yield f"{name} {acronym} (ms):", f"{getattr(dist, stat):.2f}"


def format_report(metrics: BenchMetrics, server_counters: Mapping[str, float] | None = None,
                  title: str = "Serving Benchmark Result") -> str:
    """A vLLM-style text table of the run, with per-turn TTFT and server counters."""
    width = 50
    lines = [f" {title} ".center(width, "=")]
    for label, value in _rows(metrics):
        lines.append(label.center(width, "-") if not value else f"{label:<40}{value:>10}")
    if metrics.ttft_ms_by_turn:
        lines.append("-TTFT by turn-".center(width, "-"))
        for turn, dist in metrics.ttft_ms_by_turn.items():
            lines.append(f"{f'Turn {turn} mean / p99 TTFT (ms):':<34}{dist.mean:>8.2f}{dist.p99:>8.2f}")
    if server_counters:
        lines.append("-Server counters (delta)-".center(width, "-"))
        for name, delta in server_counters.items():
            text = f"{delta:.3f}" if name.endswith(("_rate", "_length")) else f"{delta:.0f}"
            lines.append(f"{name:<40}{text:>10}" if len(name) < 40 else f"{name} {text}")
    for message, count in metrics.errors.items():
        lines.append(f"error x{count}: {message[:200]}")
    lines.append("=" * width)
    return "\n".join(lines)
