"""Arrival statistics: Poisson gaps have mean 1/rate and coefficient of variation 1."""

from __future__ import annotations

import asyncio
import math
import statistics

import pytest

from kvloom.bench.arrivals import arrival_offsets, inter_arrival_gaps, paced

N = 20_000


def test_poisson_gap_mean_and_coefficient_of_variation() -> None:
    rate = 4.0
    gaps = inter_arrival_gaps(N, rate, seed=1)
    mean, std = statistics.fmean(gaps), statistics.pstdev(gaps)
    # The sample mean's standard error is (1/rate)/sqrt(N) ~ 0.0018: allow ~5 of them.
    assert mean == pytest.approx(1 / rate, abs=0.01)
    assert std / mean == pytest.approx(1.0, abs=0.05)
    # Memorylessness in one number: P(gap > mean) = 1/e for an exponential.
    assert sum(g > 1 / rate for g in gaps) / N == pytest.approx(math.exp(-1), abs=0.02)
    assert min(gaps) >= 0


def test_gaps_are_reproducible_with_the_seed() -> None:
    assert inter_arrival_gaps(100, 2.0, seed=7) == inter_arrival_gaps(100, 2.0, seed=7)
    assert inter_arrival_gaps(100, 2.0, seed=7) != inter_arrival_gaps(100, 2.0, seed=8)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert inter_arrival_gaps(5, math.inf) == [0.0] * 5
    assert arrival_offsets(inter_arrival_gaps(5, math.inf)) == [0.0] * 5


def test_burstiness_keeps_the_mean_and_changes_the_spread() -> None:
    gaps = inter_arrival_gaps(N, 2.0, seed=3, burstiness=4.0)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.5, abs=0.02)
    assert statistics.pstdev(gaps) / mean == pytest.approx(0.5, abs=0.04)  # 1/sqrt(4)


@pytest.mark.parametrize("kwargs", [dict(num_requests=-1, request_rate=1.0),
                                    dict(num_requests=1, request_rate=0.0),
                                    dict(num_requests=1, request_rate=float("nan")),
                                    dict(num_requests=1, request_rate=1.0, burstiness=0.0)])
def test_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        inter_arrival_gaps(**kwargs)


def test_offsets_are_cumulative_with_the_first_at_zero() -> None:
    assert arrival_offsets([0.5, 0.25, 1.0]) == [0.0, 0.5, 0.75]
    assert arrival_offsets([]) == []


class SimulatedClock:
    """Time that moves only when someone sleeps or works: the schedule is checked
    exactly, with no dependence on how busy the machine is."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_paced_yields_on_absolute_schedule() -> None:
    offsets = [0.0, 0.1, 0.2, 0.3, 0.31]
    clock = SimulatedClock()

    async def collect() -> list[float]:
        start = clock()
        seen = []
        async for _ in paced(list(range(5)), offsets, start, clock=clock, sleep=clock.sleep):
            seen.append(clock() - start)
            clock.now += 0.06  # consumer work must not push later arrivals back
        return seen

    seen = asyncio.run(collect())
    # Sleeping gap by gap would drift 0.06 s per item: 0, 0.16, 0.32, 0.48, ...; the last
    # arrival is already due when the consumer comes back, so it goes at once.
    assert seen == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.36])
    with pytest.raises(ValueError):
        asyncio.run(paced([1], [], None).__anext__())
