"""What the dashboard shows, collected on the engine thread from the engine's own
numbers: ``LLMEngine.stats()`` after every loop iteration, each step's progress
(``LLMEngine.progress()``, which covers non-streaming requests too), and the
scheduler's trace ring buffer (engine/trace.py). Never from the Prometheus text.

Two kinds of data, both bounded:

- **Samples**, one per ``SAMPLE_SECONDS`` of engine time, and a closing one when the
  engine goes idle (a window of any length): throughput over the interval
  (prompt and output tokens per second, from the engine's cumulative counts), running
  and waiting requests, preemptions in the interval, KV blocks held by requests and
  cached but idle (reclaimable), the
  prefix-cache hit rate over the interval, and TTFT / ITL percentiles over the last
  ``LATENCY_WINDOW_SECONDS`` (at most the last ``LATENCY_VALUES`` values each, so a
  percentile costs a sort of a few thousand floats every sample, never of a whole
  run's).
- **Request rows** for the timeline, the ``MAX_ROWS`` most recently active requests:
  what each step did to each request (a prefill chunk, a decode, a wait and its
  reason, a preemption, the finish) as runs of steps, consecutive steps of the same
  kind and detail merged, so a request that waits 500 steps for the same reason is
  one segment.

Every change bumps ``version``; a reader asks for what changed after the version it
has (``snapshot(since)``), under the lock, so an open dashboard costs the engine a
lock and a dict lookup per changed row, not a copy of everything.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvloom.engine.output import RequestOutput, StepProgress

SAMPLE_SECONDS = 0.5
SAMPLES_KEPT = 1200  # ten minutes of samples
LATENCY_WINDOW_SECONDS = 300.0
LATENCY_VALUES = 4096
MAX_ROWS = 300
# Waiting requests recorded per step (the head of the queue): a queue of thousands
# would otherwise cost a dict lookup each per step.
MAX_WAITS_PER_STEP = 64


@dataclass(slots=True)
class RequestRow:
    """One request's row of the timeline. ``segments``: [first_step, last_step, kind,
    detail], kind one of prefill, decode, wait, preempted, finished; detail the
    tokens computed (prefill, decode: summed over the run), the wait or preemption
    reason, the finish reason."""

    request_id: str
    arrival: float | None = None  # epoch seconds
    status: str = "waiting"
    prompt_tokens: int | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    segments: list[list[Any]] = field(default_factory=list)
    version: int = 0

    def add(self, step: int, kind: str, detail: Any) -> None:
        last = self.segments[-1] if self.segments else None
        if last is not None and last[2] == kind and last[1] == step - 1:
            if kind in ("prefill", "decode"):  # a run: tokens add up
                last[1], last[3] = step, last[3] + detail
                return
            if last[3] == detail:
                last[1] = step
                return
        self.segments.append([step, step, kind, detail])

    def to_json(self) -> dict[str, Any]:
        return {"id": self.request_id, "arrival": self.arrival, "status": self.status,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "cached_tokens": self.cached_tokens, "ttft": self.ttft,
                "segments": [list(segment) for segment in self.segments]}  # the engine thread extends them


def percentiles(values: Sequence[float], points: Sequence[float] = (0.5, 0.9, 0.99)) -> list[float | None]:
    """Nearest-rank percentiles of ``values`` (None for none)."""
    if not values:
        return [None] * len(points)
    ordered = sorted(values)
    return [ordered[min(len(ordered), max(1, math.ceil(p * len(ordered)))) - 1] for p in points]


class LiveStats:
    """A StepObserver (server/async_engine.py): fed on the engine thread, read by the
    dashboard's endpoints on the event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch_offset = time.time() - time.monotonic()
        self.version = 0
        self.model = ""
        self.num_blocks = 0
        self.samples: deque[dict[str, Any]] = deque(maxlen=SAMPLES_KEPT)
        self.rows: OrderedDict[str, RequestRow] = OrderedDict()  # least recently active first
        self._last_step = 0  # the newest trace record taken
        self._window_start: float | None = None
        self._window_totals: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
        self._busy = False  # requests running or waiting at the last iteration
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=LATENCY_VALUES)
        self._itls: deque[tuple[float, float]] = deque(maxlen=LATENCY_VALUES)
        self._last_token: dict[str, float] = {}  # request id -> its previous token's time

    # ---- engine thread ---------------------------------------------------------------
    def on_step(self, engine: Any, outputs: Sequence[RequestOutput], progress: Sequence[StepProgress],
                stats: Any, now: float) -> None:
        with self._lock:
            self.model, self.num_blocks = engine.model_name, stats.num_blocks
            self._take_latencies(progress, now)
            self._take_trace(engine, now)
            for entry in progress:
                self._take_progress(entry)
            self._maybe_sample(stats, now)

    def _take_latencies(self, progress: Sequence[StepProgress], now: float) -> None:
        for entry in progress:
            if entry.num_new_tokens:
                previous = self._last_token.get(entry.request_id)
                if previous is None:
                    if entry.timeline.ttft is not None:
                        self._ttfts.append((now, entry.timeline.ttft))
                else:
                    self._itls.append((now, now - previous))
                self._last_token[entry.request_id] = now
            if entry.finished:
                self._last_token.pop(entry.request_id, None)

    def _row(self, request_id: str, engine: Any = None) -> RequestRow:
        """The request's row, made the most recent; a new one learns its arrival and
        prompt length from the engine's live request, when given."""
        row = self.rows.get(request_id)
        if row is None:
            row = self.rows[request_id] = RequestRow(request_id)
            while len(self.rows) > MAX_ROWS:
                self.rows.popitem(last=False)
            request = engine.scheduler.requests.get(request_id) if engine is not None else None
            if request is not None:
                row.arrival = request.arrival_time + self._epoch_offset
                row.prompt_tokens = request.num_prompt_tokens
        else:
            self.rows.move_to_end(request_id)
        self.version += 1
        row.version = self.version
        return row

    def _take_trace(self, engine: Any, now: float) -> None:
        """The scheduler's records since the last call, into the rows."""
        trace = getattr(engine.scheduler, "trace", None)
        records = getattr(trace, "records", None)
        if not records or records[-1].step <= self._last_step:
            return
        new = []
        for record in reversed(records):  # newest first, only as far back as needed
            if record.step <= self._last_step:
                break
            new.append(record)
        for record in reversed(new):
            step = record.step
            for entry in record.scheduled:
                row = self._row(entry.request_id, engine)
                if row.status in ("waiting", "preempted"):
                    row.status = "running"
                row.add(step, entry.kind, entry.num_tokens)
            for request_id, reason in record.preempted:
                row = self._row(request_id)
                row.status = "preempted"
                row.add(step, "preempted", reason)
            for request_id, reason in record.waiting[:MAX_WAITS_PER_STEP]:
                row = self._row(request_id, engine)
                if row.segments and row.segments[-1][0] == step and row.segments[-1][2] == "preempted":
                    continue  # preempted this step: it waits from the next one
                row.add(step, "wait", reason)
            for request_id, reason in record.finished:
                row = self._row(request_id)
                row.status = reason
                row.add(step, "finished", reason)
        self._last_step = records[-1].step

    def _take_progress(self, entry: StepProgress) -> None:
        row = self._row(entry.request_id)
        row.prompt_tokens = entry.num_prompt_tokens
        row.output_tokens = entry.num_output_tokens
        row.cached_tokens = entry.num_cached_tokens
        row.arrival = entry.timeline.arrival_time + self._epoch_offset
        row.ttft = entry.timeline.ttft
        if entry.finish_reason is not None:
            row.status = entry.finish_reason

    def _maybe_sample(self, stats: Any, now: float) -> None:
        totals = (stats.num_prompt_tokens, stats.num_generation_tokens, stats.num_preemptions,
                  stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens)
        # The engine thread blocks once idle, so the iteration that finds it newly idle
        # takes a closing sample however short its window: without it the charts would
        # show the last busy sample (requests running, blocks held) while the engine idles.
        idle = stats.num_running == 0 and stats.num_waiting == 0
        closing, self._busy = idle and self._busy, not idle
        if self._window_start is None:
            self._window_start, self._window_totals = now, totals
            return
        elapsed = now - self._window_start
        if elapsed < SAMPLE_SECONDS and not (closing and elapsed > 0):
            return
        prompt, output, preempted, queried, hits = (a - b for a, b in zip(totals, self._window_totals, strict=True))
        # A closing window can be one step long: its tokens over a whole sample period (the
        # engine idles for the rest of it), not a spike of one step's tokens over its time.
        period = max(elapsed, SAMPLE_SECONDS)
        horizon = now - LATENCY_WINDOW_SECONDS
        ttfts = [value for at, value in self._ttfts if at >= horizon]
        itls = [value for at, value in self._itls if at >= horizon]
        held = round(stats.kv_usage * stats.num_blocks)
        self.version += 1
        self.samples.append({
            "t": now + self._epoch_offset, "v": self.version,
            "prompt_tps": prompt / period, "output_tps": output / period,
            "running": stats.num_running, "waiting": stats.num_waiting, "preempted": preempted,
            "preemptions_total": stats.num_preemptions,
            # Held by requests, and cached but idle (reclaimable): together the pool's used blocks.
            "kv_used": held, "kv_cached": stats.num_blocks - stats.num_free_blocks - held,
            "hit_rate": hits / queried if queried else None,
            "ttft": percentiles(ttfts), "itl": percentiles(itls),
        })
        # After a closing sample the next window starts when the engine wakes, so that
        # the idle time does not dilute the first busy sample's rates.
        self._window_start, self._window_totals = (None, totals) if closing else (now, totals)

    # ---- event loop ------------------------------------------------------------------
    def snapshot(self, since: int = 0) -> dict[str, Any]:
        """What changed after version ``since`` (0: everything kept): new samples and
        the rows that changed, in order of their last activity."""
        with self._lock:
            return {
                "version": self.version, "model": self.model, "num_blocks": self.num_blocks,
                "samples": [sample for sample in self.samples if sample["v"] > since],
                "rows": [row.to_json() for row in self.rows.values() if row.version > since],
                "row_ids": list(self.rows),  # every row kept now, so a client drops the others
            }

    def request(self, request_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self.rows.get(request_id)
            return None if row is None else row.to_json()
