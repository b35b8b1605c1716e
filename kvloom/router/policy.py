"""Which worker gets a request: the ``RoutingPolicy`` seam and its registry.

A policy sees the request's routing key (its prompt text) and the healthy workers with
their load (requests this router has in flight on each), and returns a ``Decision``. It
runs on the router's one event loop, synchronously, so choosing and recording the choice
are one atomic step.

- ``cache_aware`` (default): the worker whose remembered text shares the longest prefix
  with the key, when that prefix is at least ``cache_threshold`` of the key ("cache_hit");
  otherwise the worker with the least remembered text, which has the most room to cache
  something new ("cache_miss"). Either choice gives way to the least loaded worker when
  it is loaded beyond the balance thresholds ("load_balance"): more than
  ``balance_abs_threshold`` requests above the least loaded, and more than
  ``balance_rel_threshold`` times its load.
- ``round_robin``: the healthy workers in turn.
- ``least_loaded``: the fewest in flight (ties: in turn).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvloom.router.prefix_tree import PrefixTree

CACHE_HIT = "cache_hit"
CACHE_MISS = "cache_miss"
LOAD_BALANCE = "load_balance"


@dataclass(frozen=True)
class PolicyConfig:
    """The cache-aware policy's knobs (the other policies have none)."""

    cache_threshold: float = 0.5
    balance_abs_threshold: int = 8
    balance_rel_threshold: float = 1.5
    max_tree_chars: int = 1_000_000  # per worker; about 250k tokens of English

    def __post_init__(self) -> None:
        # Written so that nan fails each check (a nan compared is always false).
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if not self.balance_abs_threshold >= 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}")
        if not self.balance_rel_threshold >= 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")
        if not self.max_tree_chars >= 1:
            raise ValueError(f"max_tree_chars must be >= 1, got {self.max_tree_chars}")


@dataclass(frozen=True)
class WorkerLoad:
    worker: str  # the worker's URL, its name everywhere in the router
    in_flight: int


@dataclass(frozen=True)
class Decision:
    worker: str
    reason: str  # the metric label: cache_hit, cache_miss, load_balance, or the policy's name


class RoutingPolicy(ABC):
    """Chooses a worker for each request and remembers what it needs to choose well."""

    name: ClassVar[str]

    @abstractmethod
    def route(self, key: str, candidates: Sequence[WorkerLoad]) -> Decision:
        """One of ``candidates`` (never empty) for a request with routing key ``key``;
        the choice is recorded as made (a retry elsewhere is a new ``route`` call)."""

    def forget_worker(self, worker: str) -> None:  # noqa: B027 - optional: stateless policies keep nothing
        """``worker`` went down; what it cached is gone."""


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self, config: PolicyConfig) -> None:
        self._turn = 0

    def route(self, key: str, candidates: Sequence[WorkerLoad]) -> Decision:
        choice = candidates[self._turn % len(candidates)]
        self._turn += 1
        return Decision(choice.worker, self.name)


class LeastLoaded(RoutingPolicy):
    name = "least_loaded"

    def __init__(self, config: PolicyConfig) -> None:
        self._turn = 0

    def route(self, key: str, candidates: Sequence[WorkerLoad]) -> Decision:
        self._turn += 1
        return Decision(_least_loaded(candidates, self._turn).worker, self.name)


class CacheAware(RoutingPolicy):
    name = "cache_aware"

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.tree = PrefixTree(config.max_tree_chars)
        self._turn = 0

    def route(self, key: str, candidates: Sequence[WorkerLoad]) -> Decision:
        self._turn += 1
        matched = self.tree.match(key)
        best = max(candidates, key=lambda c: matched.get(c.worker, 0))
        best_len = matched.get(best.worker, 0)
        if key and best_len > 0 and best_len >= self.config.cache_threshold * len(key):
            choice, reason = best, CACHE_HIT
        else:
            order = {c.worker: i for i, c in enumerate(candidates)}
            choice = min(candidates, key=lambda c: (self.tree.chars.get(c.worker, 0), c.in_flight,
                                                    order[c.worker]))
            reason = CACHE_MISS
        if self._overloaded(choice, candidates):
            choice, reason = _least_loaded(candidates, self._turn), LOAD_BALANCE
        self.tree.insert(key, choice.worker)
        return Decision(choice.worker, reason)

    def _overloaded(self, choice: WorkerLoad, candidates: Sequence[WorkerLoad]) -> bool:
        least = min(c.in_flight for c in candidates)
        return (choice.in_flight - least > self.config.balance_abs_threshold
                and choice.in_flight > self.config.balance_rel_threshold * least)

    def forget_worker(self, worker: str) -> None:
        self.tree.remove_worker(worker)


def _least_loaded(candidates: Sequence[WorkerLoad], turn: int) -> WorkerLoad:
    # Ties go round in turn, so an idle pool spreads requests instead of piling on one.
    least = min(c.in_flight for c in candidates)
    tied = [c for c in candidates if c.in_flight == least]
    return tied[turn % len(tied)]


POLICIES: dict[str, Callable[[PolicyConfig], RoutingPolicy]] = {
    CacheAware.name: CacheAware,
    RoundRobin.name: RoundRobin,
    LeastLoaded.name: LeastLoaded,
}


def make_policy(name: str, config: PolicyConfig | None = None) -> RoutingPolicy:
    """The policy registered as ``name``; ValueError naming the choices otherwise."""
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name](config or PolicyConfig())
