"""Measured step times as curves, for `kvloom bench pd-sim` (pd_simulation.py): a prefill
step's time as a least-squares line in its prompt tokens, a decode step's as a
piecewise-linear function of its batch, a colocated chunk step's on top of the decode
step, and the KV transfer's cost; read from a profile JSON, from `kvloom bench steps`
output, or from a `kvloom bench interference` result (the transfer)."""

from __future__ import annotations

import bisect
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PROFILE_KEYS = ("prefill_ms", "decode_ms", "mixed_ms", "kv_bytes_per_token", "transfer_bytes_per_s",
                "transfer_latency_ms")


@dataclass(frozen=True)
class LinearFit:
    intercept_ms: float
    per_token_ms: float

    def __call__(self, tokens: float) -> float:
        return self.intercept_ms + self.per_token_ms * tokens


def fit_linear(points: Sequence[Sequence[float]]) -> LinearFit:
    """The least-squares line through ``(x, ms)`` points; through the origin when every
    point has the same x (one point says nothing about the intercept)."""
    if not points:
        raise ValueError("a linear fit needs at least one point")
    xs, ys = [float(p[0]) for p in points], [float(p[1]) for p in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = math.fsum((x - mean_x) ** 2 for x in xs)
    if spread == 0.0:
        if mean_x <= 0:
            raise ValueError(f"a fit through one x needs x > 0, got {mean_x}")
        return LinearFit(0.0, mean_y / mean_x)
    slope = math.fsum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
    return LinearFit(mean_y - slope * mean_x, slope)


@dataclass(frozen=True)
class PiecewiseLinear:
    """``(x, ms)`` points sorted by x (repeated x averaged): linear between them, flat
    below the first, along the last segment above the last."""

    points: tuple[tuple[float, float], ...]

    @classmethod
    def of(cls, points: Sequence[Sequence[float]]) -> PiecewiseLinear:
        if not points:
            raise ValueError("an interpolation needs at least one point")
        by_x: dict[float, list[float]] = {}
        for x, y in points:
            by_x.setdefault(float(x), []).append(float(y))
        return cls(tuple((x, statistics.fmean(ys)) for x, ys in sorted(by_x.items())))

    def __call__(self, x: float) -> float:
        xs = [p[0] for p in self.points]
        if x <= xs[0] or len(xs) == 1:
            return self.points[0][1]
        index = min(bisect.bisect_left(xs, x), len(xs) - 1)  # the segment's right end
        (x0, y0), (x1, y1) = self.points[index - 1], self.points[index]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class StepProfile:
    """Step times of one instance (one core) and the cost of moving a prompt's KV."""

    prefill: LinearFit  # a step of T prompt tokens, no decodes
    decode: PiecewiseLinear  # a step of B decodes
    chunk: LinearFit | None = None  # measured: a chunk's cost on top of decode(B)
    kv_bytes_per_token: float = 0.0
    transfer_bytes_per_s: float = math.inf
    transfer_latency_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.kv_bytes_per_token >= 0:
            raise ValueError(f"kv_bytes_per_token must be >= 0, got {self.kv_bytes_per_token}")
        if not self.transfer_bytes_per_s > 0:
            raise ValueError(f"transfer_bytes_per_s must be > 0, got {self.transfer_bytes_per_s}")
        if not self.transfer_latency_ms >= 0:
            raise ValueError(f"transfer_latency_ms must be >= 0, got {self.transfer_latency_ms}")

    def step_ms(self, chunk_tokens: int, batch: int) -> float:
        """A step of ``chunk_tokens`` prompt tokens and ``batch`` decodes."""
        if chunk_tokens == 0:
            return self.decode(batch)
        if batch == 0:
            return self.prefill(chunk_tokens)
        extra = self.chunk(chunk_tokens) if self.chunk else self.prefill.per_token_ms * chunk_tokens
        return self.decode(batch) + extra

    def transfer_ms(self, tokens: int) -> float:
        return self.transfer_latency_ms + 1e3 * self.kv_bytes_per_token * tokens / self.transfer_bytes_per_s


_PREFILL_SHAPE = re.compile(r"prefill (\d+) x (\d+)$")
_DECODE_SHAPE = re.compile(r"decode b(\d+) x \d+$")


def points_from_steps(document: Mapping[str, Any]) -> dict[str, list[list[float]]]:
    """``prefill_ms`` and ``decode_ms`` points from a ``kvloom bench steps`` JSON: a
    "prefill COUNT x LENGTH" step is COUNT * LENGTH tokens, a "decode bB x CONTEXT" one
    batch B; each at its median."""
    points: dict[str, list[list[float]]] = {"prefill_ms": [], "decode_ms": []}
    for step in document.get("steps", []):
        ms = step["median_ms"] if "median_ms" in step else statistics.median(step["milliseconds"])
        if prefill := _PREFILL_SHAPE.match(step["shape"]):
            points["prefill_ms"].append([int(prefill[1]) * int(prefill[2]), ms])
        elif decode := _DECODE_SHAPE.match(step["shape"]):
            points["decode_ms"].append([int(decode[1]), ms])
    return {key: value for key, value in points.items() if value}


def load_profile(profile: Mapping[str, Any] | None = None, steps: Mapping[str, Any] | None = None,
                 **overrides: float | None) -> StepProfile:
    """A ``StepProfile`` from a profile document (``PROFILE_KEYS``), a ``bench steps``
    document, or both (the profile's keys win), then ``overrides`` that are not None."""
    merged: dict[str, Any] = dict(points_from_steps(steps)) if steps else {}
    merged.update(profile or {})
    merged.update({key: value for key, value in overrides.items() if value is not None})
    unknown = sorted(set(merged) - set(PROFILE_KEYS))
    if unknown:
        raise ValueError(f"unknown profile keys {unknown}; expected some of {list(PROFILE_KEYS)}")
    for key in ("prefill_ms", "decode_ms"):
        if not merged.get(key):
            raise ValueError(f"the profile needs {key} points (give --profile or --steps-json)")
    decode = PiecewiseLinear.of(merged["decode_ms"])
    chunk = (fit_linear([(tokens, ms - decode(batch)) for tokens, batch, ms in merged["mixed_ms"]])
             if merged.get("mixed_ms") else None)
    transfer = {key: float(merged[key]) for key in PROFILE_KEYS[3:] if key in merged}
    return StepProfile(fit_linear(merged["prefill_ms"]), decode, chunk, **transfer)


def transfer_from_interference(document: Mapping[str, Any]) -> dict[str, float]:
    """``kv_bytes_per_token`` and ``transfer_bytes_per_s`` from a ``bench interference``
    result against a disaggregated server: the KV bytes its long prompts' pulls moved
    per prompt token, and those bytes over the seconds the pulls took."""
    counters = document.get("transfer_counters") or {}

    def total(part: str) -> float:
        return float(sum(counter["delta"] for name, counter in counters.items() if part in name))

    moved, seconds = total("import_bytes"), total("import_seconds")
    if not moved > 0:
        raise ValueError("the result has no KV pulled (kvloom:kv_transfer_import_bytes): was it measured "
                         "against a disaggregated server?")
    parameters = document["parameters"]
    measured = {"kv_bytes_per_token": moved / (parameters["num_prompts"] * parameters["prompt_len"])}
    if seconds > 0:
        measured["transfer_bytes_per_s"] = moved / seconds
    return measured
