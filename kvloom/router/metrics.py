"""The router's ``/metrics``: the workers' metrics summed, then the router's own.

Summing: samples with the same name and labels are added across the workers that
answered (counters, histogram buckets, sums and counts, and gauges that count things:
requests running, waiting). Gauges that are ratios (names ending in ``_perc`` or
``_rate``, or holding ``mean_``) are averaged instead, since a sum of fractions means
nothing. ``*_created`` samples (a counter's creation time) are dropped. A worker that
is down or does not answer is left out, so the sums may drop while it is away;
``kvloom_router_worker_up`` says which workers are counted.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

LabelKey = tuple[tuple[str, str], ...]


class RouterMetrics:
    """The router's own counters (``kvloom_router_*``), in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        counter = functools.partial(Counter, registry=self.registry)
        gauge = functools.partial(Gauge, registry=self.registry)
        self.requests = counter(
            "kvloom_router_requests", "Requests sent to a worker, by the policy's decision "
            "(cache_hit, cache_miss, load_balance, round_robin, least_loaded).", ["worker", "decision"])
        self.retries = counter(
            "kvloom_router_retries", "Requests sent elsewhere after this worker failed before "
            "answering (connect: refused or timed out; disconnect: closed before the headers; "
            "not_ready: loading or shutting down).", ["worker", "reason"])
        self.stream_errors = counter(
            "kvloom_router_stream_errors", "Responses that broke after they started (the client got "
            "an error event or a 502).", ["worker"])
        self.unroutable = counter(
            "kvloom_router_unroutable", "Requests refused because no worker was up to take them.")
        self.worker_up = gauge("kvloom_router_worker_up", "1 while the worker is up (counted in the "
                               "sums above), 0 while it is down.", ["worker"])
        self.in_flight = gauge("kvloom_router_requests_in_flight",
                               "Requests this router has open on the worker.", ["worker"])

    def render(self) -> str:
        return generate_latest(self.registry).decode()


# Prefill legs run from milliseconds (a cached prefix) to a minute (a long prompt on CPU).
PREFILL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class DisaggMetrics:
    """Prefill/decode disaggregation's counters, in the router's registry (registered
    only by a disaggregated router, so a data-parallel one exposes what it did before)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "kvloom_router_disagg_requests", "Requests sent to each pool: prefill (the prompt, for "
            "its KV) and decode (the generation, with or without the prefill's KV).", ["role"],
            registry=registry)
        self.fallbacks = Counter(
            "kvloom_router_disagg_fallbacks", "Requests sent to a decode instance without KV after "
            "their prefill leg failed (no_prefill_worker: none up; prefill_error: a 5xx or a broken "
            "answer; no_kv_transfer_params: a 200 without them); the decode instance prefilled them.",
            ["reason"], registry=registry)
        self.skipped = Counter(
            "kvloom_router_disagg_prefill_skipped", "Requests sent straight to a decode instance "
            "(prompt_logprobs: they need the whole prompt computed there; beam_search: its rounds run "
            "there; previous_response: a Responses continuation, to the instance that stored what it "
            "continues; unreadable_body: not a JSON object, for the decode instance to refuse).", ["reason"],
            registry=registry)
        self.prefill_seconds = Histogram(
            "kvloom_router_prefill_seconds", "Seconds from sending a request to a prefill instance to "
            "its whole answer, for prefill legs that answered 200.", buckets=PREFILL_BUCKETS,
            registry=registry)


@dataclass
class _Family:
    name: str
    documentation: str
    type: str
    # (sample name, labels) -> (sum, number of workers that reported it), in first-seen order
    samples: dict[tuple[str, LabelKey], tuple[float, int]] = field(default_factory=dict)


def _averaged(family: _Family) -> bool:
    return family.type == "gauge" and (family.name.endswith(("_perc", "_rate")) or "mean_" in family.name)


def sum_metrics(texts: Iterable[str]) -> str:
    """Prometheus text expositions (one per worker) -> one exposition of their sums."""
    families: dict[str, _Family] = {}
    for text in texts:
        for parsed in text_string_to_metric_families(text):
            family = families.setdefault(parsed.name, _Family(parsed.name, parsed.documentation, parsed.type))
            for sample in parsed.samples:
                if sample.name.endswith("_created"):
                    continue
                key = (sample.name, tuple(sorted(sample.labels.items())))
                total, count = family.samples.get(key, (0.0, 0))
                family.samples[key] = (total + sample.value, count + 1)
    lines: list[str] = []
    for family in families.values():
        if not family.samples:
            continue
        # The parser names a counter without its `_total`; the exposition names it with.
        exposed = f"{family.name}_total" if family.type == "counter" else family.name
        lines.append(f"# HELP {exposed} {_escape_help(family.documentation)}")
        lines.append(f"# TYPE {exposed} {family.type}")
        for (name, labels), (total, count) in family.samples.items():
            value = total / count if _averaged(family) else total
            lines.append(f"{name}{_labels(labels)} {floatToGoString(value)}")  # type: ignore[no-untyped-call]
    return "\n".join(lines) + "\n" if lines else ""


def _labels(labels: LabelKey) -> str:
    if not labels:
        return ""
    # `le` (histogram buckets) stays last as prometheus_client writes it.
    ordered = sorted(labels, key=lambda item: item[0] == "le")
    inner = ",".join(f'{k}="{_escape_label(v)}"' for k, v in ordered)
    return "{" + inner + "}"


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")
