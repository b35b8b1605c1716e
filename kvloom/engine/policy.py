"""Scheduling policies: who runs first, who waits, who is preempted.

A policy only orders; the scheduler enforces budgets, memory and the starvation
bound. Policies are registered by name and chosen with ``--policy``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from kvloom.request import Request


class SchedulingPolicy(ABC):
    name: str = ""

    @abstractmethod
    def order_waiting(self, waiting: list[Request]) -> list[Request]:
        """Waiting requests in the order they should be admitted."""

    def order_running(self, running: list[Request]) -> list[Request]:
        """Running requests in the order they get budget; victims come from the tail."""
        return running

    def pick_victim(self, candidates: list[Request]) -> Request:
        """The request to preempt when memory runs out; default: the latest admitted."""
        return candidates[-1]


class FCFSPolicy(SchedulingPolicy):
    """First come, first served. Preempted requests sit at the head of the queue."""

    name = "fcfs"

    def order_waiting(self, waiting: list[Request]) -> list[Request]:
        return waiting


class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` value first (vLLM's convention); ties by arrival."""

    name = "priority"

    @staticmethod
    def _key(request: Request) -> tuple[int, int]:
        return (request.priority, request.arrival_index)

    def order_waiting(self, waiting: list[Request]) -> list[Request]:
        return sorted(waiting, key=self._key)

    def order_running(self, running: list[Request]) -> list[Request]:
        return sorted(running, key=self._key)

    def pick_victim(self, candidates: list[Request]) -> Request:
        return max(candidates, key=self._key)


class LeastProgressVictimPolicy(FCFSPolicy):
    """FCFS admission; preempts the request that is cheapest to recompute."""

    name = "fcfs-cheapest-victim"

    def pick_victim(self, candidates: list[Request]) -> Request:
        return min(reversed(candidates), key=lambda r: r.num_computed_tokens)


POLICIES: dict[str, Callable[[], SchedulingPolicy]] = {
    FCFSPolicy.name: FCFSPolicy,
    PriorityPolicy.name: PriorityPolicy,
    LeastProgressVictimPolicy.name: LeastProgressVictimPolicy,
}


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}") from None
