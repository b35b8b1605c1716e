"""Scheduling policies: who is admitted first, who runs first, who is preempted.

A policy only orders and vetoes; the scheduler enforces budgets, memory and the
starvation bound. Policies are registered by name and chosen with ``--policy``.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable

from kvloom.cache.kv_manager import KVCacheManager
from kvloom.cache.windows import cdiv
from kvloom.config import SchedulerConfig
from kvloom.engine.trace import WaitReason
from kvloom.request import Request

logger = logging.getLogger(__name__)


class SchedulingPolicy(ABC):
    name: str = ""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        # Steps in which the policy could not apply its own order and used FCFS instead.
        self.num_fcfs_fallbacks = 0

    @abstractmethod
    def order_waiting(self, waiting: list[Request], kv: KVCacheManager) -> list[Request]:
        """Waiting requests in the order they should be admitted."""

    def order_running(self, running: list[Request]) -> list[Request]:
        """Running requests in the order they get budget; victims come from the tail."""
        return running

    def pick_victim(self, candidates: list[Request]) -> Request:
        """The request to preempt when memory runs out (candidates in admission order);
        default: the most recently admitted."""
        return candidates[-1]

    def refuse_admission(self, request: Request, kv: KVCacheManager) -> WaitReason | None:
        """A reason to keep ``request`` waiting even though its first chunk fits."""
        return None


class FCFSPolicy(SchedulingPolicy):
    """First come, first served. Preempted requests sit at the head of the queue."""

    name = "fcfs"

    def order_waiting(self, waiting: list[Request], kv: KVCacheManager) -> list[Request]:
        return waiting


class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` value first (vLLM's convention); ties by arrival. The victim
    is the lowest-priority (then latest) running request."""

    name = "priority"

    @staticmethod
    def _key(request: Request) -> tuple[int, int]:
        return (request.priority, request.arrival_index)

    def order_waiting(self, waiting: list[Request], kv: KVCacheManager) -> list[Request]:
        return sorted(waiting, key=self._key)

    def order_running(self, running: list[Request]) -> list[Request]:
        return sorted(running, key=self._key)

    def pick_victim(self, candidates: list[Request]) -> Request:
        return max(candidates, key=self._key)


class CheapestVictimPolicy(FCFSPolicy):
    """FCFS admission; preempts the request that is cheapest to recompute (least progress)."""

    name = "fcfs-cheapest-victim"

    def pick_victim(self, candidates: list[Request]) -> Request:
        return min(reversed(candidates), key=lambda r: r.num_computed_tokens)


class WatermarkPolicy(FCFSPolicy):
    """FCFS with watermark admission control, to avoid preemption thrash.

    Below ``low_watermark`` KV use, admit whenever the first chunk fits. Between the
    watermarks, admit only if the whole prompt fits in the free blocks. Above
    ``high_watermark``, admit only if prompt + max_tokens (its full expected growth) fits
    (under a sliding window in every layer, what it holds at once: ``blocks_to_finish``).
    """

    name = "watermark"

    def refuse_admission(self, request: Request, kv: KVCacheManager) -> WaitReason | None:
        usage = kv.usage
        if usage < self.config.low_watermark:
            return None
        blocks = cdiv(request.num_tokens, kv.block_size)
        if usage >= self.config.high_watermark:
            blocks = kv.blocks_to_finish(request)  # under a sliding window, its prompt and a window
        if blocks > kv.num_available_blocks:
            return WaitReason.WATERMARK
        return None


class LongestPrefixMatchPolicy(FCFSPolicy):
    """Cache-aware: waiting requests with the longest cached prefix first (SGLang's LPM),
    so requests sharing a prefix run while it is still cached. Ties keep FCFS order.

    Scoring walks the radix tree once per waiting request per step; past
    ``MAX_SCORED`` waiting requests that cost is not worth it and the policy orders
    FCFS instead, counting each such step in ``num_fcfs_fallbacks`` (exported as a
    stat) rather than degrading silently. The scheduler's starvation bound applies.
    """

    name = "lpm"
    MAX_SCORED = 256

    def order_waiting(self, waiting: list[Request], kv: KVCacheManager) -> list[Request]:
        if len(waiting) > self.MAX_SCORED:
            if not self.num_fcfs_fallbacks:
                logger.warning("lpm policy: %d requests waiting (> %d): ordering FCFS while the "
                               "queue is this long (counted in stats.num_policy_fallbacks)",
                               len(waiting), self.MAX_SCORED)
            self.num_fcfs_fallbacks += 1
            return waiting
        cache = kv.prefix_cache
        scores = {r: cache.cached_prefix_length(r.all_token_ids[: r.num_tokens - 1], r.cache_key) for r in waiting}
        return sorted(waiting, key=lambda r: -scores[r])  # stable: FCFS among equals


POLICIES: dict[str, Callable[[SchedulerConfig], SchedulingPolicy]] = {
    cls.name: cls for cls in (FCFSPolicy, PriorityPolicy, CheapestVictimPolicy, WatermarkPolicy,
                             LongestPrefixMatchPolicy)
}


def register_policy(cls: type[SchedulingPolicy]) -> type[SchedulingPolicy]:
    POLICIES[cls.name] = cls
    return cls


def make_policy(config: SchedulerConfig) -> SchedulingPolicy:
    try:
        return POLICIES[config.policy](config)
    except KeyError:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {config.policy!r}") from None
