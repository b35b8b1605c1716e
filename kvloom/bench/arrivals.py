"""Request arrival processes for the serving benchmark.

A rate of ``r`` requests per second is a Poisson process: inter-arrival gaps are
independent exponentials with mean ``1 / r`` (coefficient of variation 1). The
``burstiness`` knob generalises it the way vLLM's client does: gaps are
Gamma(shape=burstiness, scale=1 / (rate * burstiness)), which keeps the mean at
``1 / r`` while the coefficient of variation becomes ``1 / sqrt(burstiness)``
(< 1: more regular, > 1: burstier; 1: Poisson). ``rate = inf`` sends everything
at once.

Gaps come from a seeded ``random.Random``, so a workload's schedule is part of
its fingerprint and identical across the engines it compares.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

__all__ = ["arrival_offsets", "inter_arrival_gaps", "paced"]

T = TypeVar("T")


def inter_arrival_gaps(num_requests: int, request_rate: float, seed: int = 0,
                       burstiness: float = 1.0) -> list[float]:
    """``num_requests`` gaps in seconds, each the wait before the next arrival.

    ``request_rate`` is in requests per second; ``math.inf`` gives all zeros.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:  # also rejects NaN
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0 or math.isinf(burstiness):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    if burstiness == 1.0:
        return [rng.expovariate(request_rate) for _ in range(num_requests)]
    scale = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(num_requests)]


def arrival_offsets(gaps: Sequence[float]) -> list[float]:
    """Send times relative to the start: the first request goes at 0, request ``i``
    after ``gaps[0] + ... + gaps[i - 1]`` (the last gap is never waited for)."""
    offsets, now = [], 0.0
    for gap in gaps:
        offsets.append(now)
        now += gap
    return offsets


async def paced(items: Sequence[T], offsets: Sequence[float], start: float | None = None,
                clock: Callable[[], float] = time.perf_counter,
                sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> AsyncIterator[T]:
    """Yield ``items[i]`` once ``offsets[i]`` seconds have passed since ``start``
    (``clock()``, default now).

    Waits for absolute times, not successive gaps, so time spent by the consumer
    between yields does not push later arrivals back (no drift). ``clock`` and
    ``sleep`` are seams for tests, which check the schedule on a simulated clock.
    """
    if len(items) != len(offsets):
        raise ValueError(f"{len(items)} items but {len(offsets)} offsets")
    start = clock() if start is None else start
    for item, offset in zip(items, offsets, strict=True):
        delay = start + offset - clock()
        if delay > 0:
            await sleep(delay)
        yield item
