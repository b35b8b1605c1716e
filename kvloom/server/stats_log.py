"""The periodic stats line of ``kvloom serve`` (vLLM's "Avg prompt throughput: ..."),
decided and formatted here from ``EngineStats`` and a clock reading the caller passes in,
so the rule is a pure unit: the engine thread feeds it, tests feed it fake times.

Rule: while the engine is busy, one line every ``interval`` seconds, covering that
window: prompt and generation throughput, running / waiting requests, KV pool usage and
the window's prefix-cache hit rate. When the engine goes idle, one last line for the
unfinished window (so the final counts show), then nothing until work arrives again;
the window restarts when it does (``resume``), so an idle hour never dilutes a rate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type only: this module stays a pure, torch-free unit
    from kvloom.engine.engine import EngineStats


def format_stats_line(stats: EngineStats, elapsed: float, prompt_tokens: int, generation_tokens: int,
                      queried_tokens: int, hit_tokens: int) -> str:
    """One line for a window of ``elapsed`` seconds and the token counts within it."""
    seconds = max(elapsed, 1e-9)
    hit_rate = 100.0 * hit_tokens / queried_tokens if queried_tokens else 0.0
    return (f"Avg prompt throughput: {prompt_tokens / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {generation_tokens / seconds:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {100.0 * stats.kv_usage:.1f}%, "
            f"Prefix cache hit rate: {hit_rate:.1f}%")


class StatsLogger:
    """Feed ``observe(now, stats)`` after every engine step (and once when it goes
    idle), ``resume(now)`` when it wakes from idle; log the lines they return."""

    def __init__(self, interval: float, now: float) -> None:
        if not interval > 0:
            raise ValueError(f"stats log interval must be > 0 seconds, got {interval!r}")
        self.interval = interval
        self._window_start = now
        self._idle = True
        self._base = (0, 0, 0, 0)  # prompt, generation, queried, hit tokens at window start

    def resume(self, now: float) -> None:
        """The engine leaves idle at ``now``: the next window starts here."""
        if self._idle:
            self._window_start = now
            self._idle = False

    def observe(self, now: float, stats: EngineStats) -> str | None:
        counts = (stats.num_prompt_tokens, stats.num_generation_tokens,
                  stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens)
        deltas = [count - base for count, base in zip(counts, self._base, strict=True)]
        idle = stats.num_running == 0 and stats.num_waiting == 0
        if idle and self._idle and not any(deltas):
            return None
        self._idle = False
        if not idle and now - self._window_start < self.interval:
            return None
        line = format_stats_line(stats, now - self._window_start, *deltas) if any(deltas) or not idle else None
        self._window_start, self._base, self._idle = now, counts, idle
        return line
