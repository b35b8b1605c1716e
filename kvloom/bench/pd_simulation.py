"""`kvloom bench pd-sim`: N prefill : M decode instances against N + M colocated ones,
simulated from measured step times (DistServe's placement question: when does the
split pay off?).

The model, in milliseconds:

- A prefill step of T prompt tokens takes ``a + b * T`` (a least-squares line through the
  measured points); a decode step of B sequences the measured time at B, linear between
  points (flat below the smallest batch measured, along the last segment above the
  largest). The context length of the decoding sequences does not enter.
- Colocated (kvloom's scheduler with chunked prefill): a step advances every decoding
  request by one token and spends the rest of the token budget on prompt chunks, FCFS
  (prompts already started first); it takes ``decode(B) + b * C`` for a C-token chunk
  (``decode(B) + c0 + c1 * C`` when measured ``mixed_ms`` points give the line), or
  ``a + b * C`` without decodes. A prompt's last chunk samples its first token.
- Disaggregated: a prefill instance computes one prompt at a time, FCFS (or as many
  whole prompts as fit ``prefill_token_budget``). The KV then moves to the least-loaded
  decode instance in ``latency + prompt tokens * bytes per token / rate`` (transfers
  overlap each other and the steps), and the request joins that instance's batch at its
  next step (continuous batching, at most ``max_batch`` running, the rest waiting in
  order of arrival). The first token comes from that step (``first_token_on="decode"``,
  kvloom's router: the decode instance computes the prompt's last token, as for a prefix
  hit) or from the end of the prefill (``"prefill"``, DistServe's accounting).
- Requests arrive as a seeded Poisson process and go to the least-loaded instance
  (fewest unfinished requests; the lowest index on ties). ITL is every gap between a
  request's consecutive tokens (with ``first_token_on="prefill"`` a disaggregated request's
  first gap holds its transfer).

Goodput is the fraction of requests whose TTFT and ITL statistic (``mean``: TPOT, as
DistServe; ``p99`` or ``max`` of the request's gaps) are within the SLOs; a placement
meets the SLO at a rate when that fraction reaches ``attainment`` (DistServe's 90%).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvloom.bench.arrivals import arrival_offsets, inter_arrival_gaps
from kvloom.bench.extras import require_bench_package
from kvloom.bench.metrics import percentile
from kvloom.bench.step_profile import (
    LinearFit,
    PiecewiseLinear,
    StepProfile,
    fit_linear,
    load_profile,
    points_from_steps,
    transfer_from_interference,
)

__all__ = ["LinearFit", "PiecewiseLinear", "Scheduling", "SimRequest", "Slo", "StepProfile", "Workload",
           "fit_linear", "format_table", "load_profile", "plot_sweep", "points_from_steps", "run_sweep",
           "simulate_colocated", "simulate_disaggregated", "summarise", "transfer_from_interference"]

ITL_STATS = ("mean", "p99", "max")


# ---------------------------------------------------------------- workload and policy
@dataclass(slots=True, eq=False)
class SimRequest:
    arrival_ms: float
    prompt_len: int
    output_len: int
    computed: int = 0  # prompt tokens computed
    token_times: list[float] = field(default_factory=list)  # ms at which each output token came

    @property
    def done(self) -> bool:
        return len(self.token_times) >= self.output_len


@dataclass(frozen=True)
class Workload:
    """``num_requests`` requests with lengths drawn uniformly from the given lists
    (seeded: every rate gets the same lengths and the same arrival pattern, scaled)."""

    num_requests: int
    prompt_lens: tuple[int, ...] = (1500,)
    output_lens: tuple[int, ...] = (128,)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        for name in ("prompt_lens", "output_lens"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be a non-empty list of lengths >= 1")

    def requests(self, rate: float) -> list[SimRequest]:
        rng = random.Random(self.seed)
        offsets = arrival_offsets(inter_arrival_gaps(self.num_requests, rate, self.seed))
        return [SimRequest(1e3 * offset, rng.choice(self.prompt_lens), rng.choice(self.output_lens))
                for offset in offsets]


@dataclass(frozen=True)
class Scheduling:
    token_budget: int = 2048  # colocated: tokens per step, one per decode and the prompt chunks
    max_batch: int = 256  # running requests per decode or colocated instance
    prefill_token_budget: int | None = None  # a prefill instance's step: whole prompts up to this
    # Disaggregated: where the first token is sampled. "decode" (kvloom's router): the decode
    # instance computes the prompt's last token once the KV is in, in its next step, as for a
    # prefix hit; "prefill" (DistServe): at the end of the prefill, before the transfer.
    first_token_on: str = "decode"

    def __post_init__(self) -> None:
        if self.first_token_on not in ("decode", "prefill"):
            raise ValueError(f"first_token_on must be 'decode' or 'prefill', got {self.first_token_on!r}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.token_budget <= self.max_batch:
            raise ValueError(f"token_budget ({self.token_budget}) must exceed max_batch ({self.max_batch}): "
                             "a step must advance every decode and still have room for a chunk")


# ---------------------------------------------------------------- the simulation
class _Events:
    """A time-ordered queue of actions; ties run in the order they were scheduled."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._order = itertools.count()

    def at(self, time_ms: float, action: Callable[[float], None]) -> None:
        heapq.heappush(self._heap, (time_ms, next(self._order), action))

    def run(self) -> None:
        while self._heap:
            time_ms, _, action = heapq.heappop(self._heap)
            action(time_ms)


class _Instance:
    """One instance running one step at a time; ``_plan`` says what a step holds:
    ``(request, tokens)`` pairs (prompt tokens while prefilling, else one decode)."""

    def __init__(self, events: _Events, profile: StepProfile, scheduling: Scheduling,
                 prefilled: Callable[[SimRequest, float], None] | None = None) -> None:
        self.events, self.profile, self.scheduling = events, profile, scheduling
        self.prefilled = prefilled  # a prefill instance hands its requests on at the step's end
        self.samples_first_token = prefilled is None or scheduling.first_token_on == "prefill"
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.incoming = 0  # routed here, KV still moving
        self.busy = False

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running) + self.incoming

    def submit(self, request: SimRequest, now: float) -> None:
        self.waiting.append(request)
        if not self.busy:
            # Started as an event after those already due now: requests that arrive
            # together share the step.
            self.busy = True
            self.events.at(now, self._start)

    def _plan(self) -> list[tuple[SimRequest, int]]:
        raise NotImplementedError

    def _start(self, now: float) -> None:
        work = self._plan()
        self.busy = bool(work)
        if work:
            chunk = sum(tokens for request, tokens in work if request.computed < request.prompt_len)
            decodes = sum(1 for request, _ in work if request.computed >= request.prompt_len)
            self.events.at(now + self.profile.step_ms(chunk, decodes), lambda end: self._finish(work, end))

    def _finish(self, work: list[tuple[SimRequest, int]], end: float) -> None:
        for request, tokens in work:
            if request.computed < request.prompt_len:
                request.computed += tokens
                if request.computed == request.prompt_len and self.samples_first_token:
                    request.token_times.append(end)  # the last chunk samples the first token
            else:
                request.token_times.append(end)
        if self.prefilled is not None:
            for request in self.running:
                if not request.done:
                    self.prefilled(request, end)
            self.running.clear()
        else:
            self.running = [request for request in self.running if not request.done]
        self._start(end)


class _ColocatedInstance(_Instance):
    def _plan(self) -> list[tuple[SimRequest, int]]:
        # kvloom's order: the running decodes, then the prompts already started, then
        # waiting prompts admitted while the budget and the batch have room.
        work = [(r, 1) for r in self.running if r.computed >= r.prompt_len]
        budget = self.scheduling.token_budget - len(work)
        for request in self.running:
            if request.computed < request.prompt_len and budget > 0:
                work.append((request, min(request.prompt_len - request.computed, budget)))
                budget -= work[-1][1]
        while self.waiting and budget > 0 and len(self.running) < self.scheduling.max_batch:
            request = self.waiting.popleft()
            self.running.append(request)
            work.append((request, min(request.prompt_len, budget)))
            budget -= work[-1][1]
        return work


class _PrefillInstance(_Instance):
    def _plan(self) -> list[tuple[SimRequest, int]]:
        budget = self.scheduling.prefill_token_budget or 0
        tokens = 0
        while self.waiting and (not self.running or tokens + self.waiting[0].prompt_len <= budget):
            request = self.waiting.popleft()
            self.running.append(request)
            tokens += request.prompt_len
        return [(r, r.prompt_len) for r in self.running]


class _DecodeInstance(_Instance):
    def arrive(self, request: SimRequest, now: float) -> None:
        self.incoming -= 1
        self.submit(request, now)

    def _plan(self) -> list[tuple[SimRequest, int]]:
        while self.waiting and len(self.running) < self.scheduling.max_batch:
            self.running.append(self.waiting.popleft())
        return [(r, 1) for r in self.running]


def _least_loaded(instances: Sequence[_Instance]) -> _Instance:
    return min(instances, key=lambda instance: instance.load)  # the first of the least loaded


def _arrive_at(events: _Events, requests: list[SimRequest], instances: Sequence[_Instance]) -> None:
    def route(request: SimRequest) -> Callable[[float], None]:
        return lambda now: _least_loaded(instances).submit(request, now)

    for request in requests:
        events.at(request.arrival_ms, route(request))


def simulate_colocated(requests: list[SimRequest], profile: StepProfile, scheduling: Scheduling,
                       num_instances: int) -> list[SimRequest]:
    """Serve ``requests`` on colocated instances; returns them with their token times."""
    events = _Events()
    _arrive_at(events, requests, [_ColocatedInstance(events, profile, scheduling) for _ in range(num_instances)])
    events.run()
    return requests


def simulate_disaggregated(requests: list[SimRequest], profile: StepProfile, scheduling: Scheduling,
                           num_prefill: int, num_decode: int) -> list[SimRequest]:
    """Serve ``requests`` on prefill and decode instances; returns them with their token times."""
    events = _Events()
    decoders = [_DecodeInstance(events, profile, scheduling) for _ in range(num_decode)]

    def hand_off(request: SimRequest, now: float) -> None:
        target = _least_loaded(decoders)
        assert isinstance(target, _DecodeInstance)
        target.incoming += 1
        events.at(now + profile.transfer_ms(request.prompt_len), lambda end: target.arrive(request, end))

    _arrive_at(events, requests, [_PrefillInstance(events, profile, scheduling, hand_off)
                                  for _ in range(num_prefill)])
    events.run()
    return requests


# ---------------------------------------------------------------- metrics
@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    itl_ms: float
    itl_stat: str = "mean"  # of a request's gaps: mean (TPOT), p99 or max
    attainment: float = 0.9  # the share of requests that must meet both

    def __post_init__(self) -> None:
        if self.itl_stat not in ITL_STATS:
            raise ValueError(f"itl_stat must be one of {ITL_STATS}, got {self.itl_stat!r}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")

    def met_by(self, request: SimRequest) -> bool:
        return (request.token_times[0] - request.arrival_ms <= self.ttft_ms
                and self.itl_of(request) <= self.itl_ms)

    def itl_of(self, request: SimRequest) -> float:
        """The request's ITL statistic (0 with fewer than two tokens)."""
        gaps = [b - a for a, b in itertools.pairwise(request.token_times)]
        if not gaps:
            return 0.0
        if self.itl_stat == "mean":
            return statistics.fmean(gaps)
        return max(gaps) if self.itl_stat == "max" else percentile(gaps, 99)


def summarise(requests: Sequence[SimRequest], slo: Slo) -> dict[str, float]:
    """TTFT and pooled ITL percentiles (ms), output throughput (tokens per second from the
    first arrival to the last token) and the share of requests meeting the SLO."""
    ttfts = [r.token_times[0] - r.arrival_ms for r in requests]
    gaps = [b - a for r in requests for a, b in itertools.pairwise(r.token_times)]
    span_ms = max(r.token_times[-1] for r in requests) - min(r.arrival_ms for r in requests)
    tokens = sum(len(r.token_times) for r in requests)
    return {"ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
            "itl_p50_ms": percentile(gaps, 50) if gaps else 0.0,
            "itl_p99_ms": percentile(gaps, 99) if gaps else 0.0,
            "throughput_tok_s": 1e3 * tokens / span_ms if span_ms > 0 else math.inf,
            "slo_attainment": sum(slo.met_by(r) for r in requests) / len(requests)}


# ---------------------------------------------------------------- the sweep
def run_sweep(profile: StepProfile, scheduling: Scheduling, workload: Workload, rates: Sequence[float],
              splits: Sequence[tuple[int, int]], slo: Slo) -> dict[str, Any]:
    """Each N:M split and N + M colocated instances at each rate: rows of ``summarise``,
    and a line per split on which placement holds the SLO to the higher rate."""
    if not rates or not all(0 < rate < math.inf for rate in rates):
        raise ValueError(f"rates must be finite request rates > 0, got {list(rates)}")
    rows: list[dict[str, Any]] = []
    colocated_done: set[int] = set()
    for num_prefill, num_decode in splits:
        if num_prefill < 1 or num_decode < 1:
            raise ValueError(f"a split needs >= 1 prefill and >= 1 decode instance, got {num_prefill}:{num_decode}")
        for rate in rates:
            served = simulate_disaggregated(workload.requests(rate), profile, scheduling, num_prefill, num_decode)
            rows.append({"placement": f"{num_prefill}P:{num_decode}D", "instances": num_prefill + num_decode,
                         "rate": rate, **summarise(served, slo)})
        total = num_prefill + num_decode
        if total not in colocated_done:
            colocated_done.add(total)
            for rate in rates:
                served = simulate_colocated(workload.requests(rate), profile, scheduling, total)
                rows.append({"placement": f"colocated x{total}", "instances": total, "rate": rate,
                             **summarise(served, slo)})
    return {"profile": _profile_json(profile), "scheduling": asdict(scheduling), "workload": asdict(workload),
            "slo": asdict(slo), "rows": rows, "summary": [_verdict(rows, split, slo) for split in splits]}


def _profile_json(profile: StepProfile) -> dict[str, Any]:
    data = asdict(profile)
    if math.isinf(profile.transfer_bytes_per_s):
        data["transfer_bytes_per_s"] = "inf"  # JSON has no Infinity
    return data


def _highest_rate_meeting(rows: Sequence[Mapping[str, Any]], placement: str, slo: Slo) -> float | None:
    rates = [row["rate"] for row in rows if row["placement"] == placement and row["slo_attainment"] >= slo.attainment]
    return max(rates, default=None)


def _verdict(rows: Sequence[Mapping[str, Any]], split: tuple[int, int], slo: Slo) -> str:
    total = sum(split)
    split_rate = _highest_rate_meeting(rows, f"{split[0]}P:{split[1]}D", slo)
    colocated_rate = _highest_rate_meeting(rows, f"colocated x{total}", slo)

    highest = max(row["rate"] for row in rows)

    def text(rate: float | None) -> str:
        if rate is None:
            return "at no rate swept"
        return f"up to {rate:g} req/s ({rate / total:.3g} per core{', the highest swept' * (rate == highest)})"

    if (split_rate or 0.0) > (colocated_rate or 0.0):
        verdict = "the split pays off"
    elif (split_rate or 0.0) < (colocated_rate or 0.0):
        verdict = "colocated wins"
    else:
        verdict = "a tie at the rates swept"
    return (f"{split[0]}P:{split[1]}D vs {total} colocated ({slo.attainment:.0%} meeting the SLO): "
            f"split {text(split_rate)}, colocated {text(colocated_rate)}: {verdict}")


def format_table(result: Mapping[str, Any]) -> str:
    header = (f"{'placement':<14}{'rate/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}"
              f"{'ITL p99':>9}{'tok/s':>9}{'SLO met':>9}")
    lines = [header, "-" * len(header)]
    for row in result["rows"]:
        lines.append(f"{row['placement']:<14}{row['rate']:>8g}{row['ttft_p50_ms']:>10.0f}{row['ttft_p99_ms']:>10.0f}"
                     f"{row['itl_p50_ms']:>9.1f}{row['itl_p99_ms']:>9.1f}{row['throughput_tok_s']:>9.1f}"
                     f"{row['slo_attainment']:>9.0%}")
    slo = result["slo"]
    lines.append(f"(ms; SLO: TTFT <= {slo['ttft_ms']:g} ms and ITL {slo['itl_stat']} <= {slo['itl_ms']:g} ms)")
    return "\n".join(lines + list(result["summary"]))


def plot_sweep(result: Mapping[str, Any], path: str) -> None:
    """p99 ITL, p99 TTFT and SLO attainment against the request rate, a line per placement."""
    require_bench_package("matplotlib", "kvloom bench pd-sim --plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(15, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 3)
    placements = dict.fromkeys(row["placement"] for row in result["rows"])
    for axis, (key, title) in zip(axes, (("itl_p99_ms", "p99 ITL (ms)"), ("ttft_p99_ms", "p99 TTFT (ms)"),
                                         ("slo_attainment", "share meeting the SLO")), strict=True):
        for placement in placements:
            rows = sorted((r for r in result["rows"] if r["placement"] == placement), key=lambda r: r["rate"])
            axis.plot([r["rate"] for r in rows], [r[key] for r in rows], marker="o", label=placement,
                      linestyle="--" if placement.startswith("colocated") else "-")
        axis.set_xlabel("request rate (req/s)")
        axis.set_title(title)
        if key != "slo_attainment":
            axis.set_yscale("log")
        axis.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.savefig(path, dpi=120)
