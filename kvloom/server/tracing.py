"""OpenTelemetry traces: one span per finished request (``--otlp-traces-endpoint``).

What it emits: a span named ``llm_request`` (vLLM's name, so dashboards built for
vLLM read it), kind SERVER, from the request's arrival to its finish, exported over
OTLP/HTTP (protobuf) in batches. Attributes follow vLLM's ``SpanAttributes`` where
they exist (the gen_ai.* semantic conventions plus vLLM's gen_ai.latency.*):

* ``gen_ai.request.id``, ``gen_ai.response.model``, ``gen_ai.usage.prompt_tokens``,
  ``gen_ai.usage.completion_tokens``; ``gen_ai.request.max_tokens`` (the effective
  limit: the requested value capped by the context), ``temperature`` and ``top_p``
  when the tracer saw the request alive (below);
* latencies in seconds: ``time_in_queue`` (arrival -> first scheduled),
  ``time_to_first_token``, ``e2e``, ``time_in_model_prefill`` (first scheduled ->
  first token), ``time_in_model_decode`` (first -> last token),
  ``time_in_model_inference`` (first scheduled -> last token);
* kvloom's own: ``kvloom.cached_tokens`` (prompt tokens the prefix cache served),
  ``kvloom.cache_miss_reason``, ``kvloom.num_preemptions``, ``kvloom.finish_reason``,
  ``kvloom.latency.mean_inter_token``; a failed request's message as
  ``kvloom.error`` and the span status ERROR.

Events, with their own timestamps: ``queued``, ``scheduled``, ``first_token``, one
``preempted`` per preemption (attribute ``scheduler.step``), ``finished``. Why these:
time to first token, inter-token latency and prefix-cache hits are the numbers to
watch on an LLM server, and a span per request shows *which* requests were slow and
why (queued behind others, preempted and recomputed, a cold cache) where the
Prometheus histograms (server/metrics.py) show only the distribution.

Where the data comes from: the finished ``RequestOutput`` carries the token counts
and the timeline (kvloom/request.py, monotonic seconds, converted to epoch
nanoseconds with one offset taken at construction). It does not carry the sampling
params, so the tracer keeps a reference to each request while it is alive in
``engine.scheduler.requests`` (read, never changed). A request that arrives and
finishes within one engine iteration is never seen alive: its span has no
``gen_ai.request.*`` sampling attributes. ``gen_ai.request.n`` is never set: the
server fans ``n`` out into separate engine requests (one span each), so the
engine never sees the HTTP request's ``n``. An aborted request (a client gone)
produces no output; the tracer notices it leave the scheduler and emits its span
from the request itself, with finish reason "abort".

The provider is this tracer's own, not the global one: two servers in one process
(tests, ``kvloom bench``) must not send each other's spans or shut each other down.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from kvloom.engine.engine import LLMEngine
from kvloom.engine.output import RequestOutput, StepProgress
from kvloom.request import Request, RequestTimeline

SPAN_NAME = "llm_request"


@dataclass(slots=True)
class _Live:
    """A request the tracer has seen in the scheduler, and when it saw each preemption."""

    request: Request
    # The timeline records a preemption's step, not its time: entry i is the end of the
    # engine iteration in which the tracer first saw preemption i (at most one step late).
    preempted_at: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Finished:
    """What one span is made of, from a finished output or an aborted request."""

    request_id: str
    timeline: RequestTimeline | None
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int
    cache_miss_reason: str | None
    finish_reason: str | None
    error: str | None


class RequestTracer:
    """A StepObserver (server/async_engine.py) that exports a span per finished request."""

    def __init__(self, endpoint: str, service_name: str = "kvloom", model_name: str | None = None) -> None:
        """``model_name``: gen_ai.response.model (e.g. the served name); None: the engine's."""
        self._model_name = model_name
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("kvloom.server.tracing")
        # monotonic seconds -> epoch ns: one offset for the tracer's life, so the gaps
        # between one span's timestamps are exactly the monotonic ones.
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()
        self._live: dict[str, _Live] = {}
        self._num_preemptions_seen: int | None = None

    def on_step(self, engine: LLMEngine, outputs: Sequence[RequestOutput], progress: Sequence[StepProgress],
                stats: Any, now: float) -> None:
        requests = engine.scheduler.requests
        for request_id in requests.keys() - self._live.keys():
            self._live[request_id] = _Live(requests[request_id])
        # Scan for new preemptions only when the engine's count moved (a scan costs a
        # pass over every live request; most steps preempt nothing).
        num_preemptions = getattr(stats, "num_preemptions", None)
        if num_preemptions is None or num_preemptions != self._num_preemptions_seen:
            self._num_preemptions_seen = num_preemptions
            for alive in self._live.values():
                missing = len(alive.request.timeline.preempted_steps) - len(alive.preempted_at)
                alive.preempted_at.extend([now] * missing)
        for output in outputs:
            if output.finished:
                live = self._live.pop(output.request_id, None)
                self._emit(engine, _from_output(output), live, now)
        # Left the scheduler with no finished output: aborted (engine.abort_request).
        for request_id in self._live.keys() - requests.keys():
            live = self._live.pop(request_id)
            self._emit(engine, _from_request(live.request), live, now)

    def close(self) -> None:
        """Export what is still batched and stop the exporter (idempotent)."""
        self._provider.shutdown()

    def _emit(self, engine: LLMEngine, finished: _Finished, live: _Live | None, now: float) -> None:
        timeline = finished.timeline or RequestTimeline(arrival_time=now, finished_time=now)
        finished_time = timeline.finished_time if timeline.finished_time is not None else now
        attributes: dict[str, AttributeValue] = {
            "gen_ai.request.id": finished.request_id,
            "gen_ai.response.model": self._model_name or engine.model_name,
            "gen_ai.usage.prompt_tokens": finished.num_prompt_tokens,
            "gen_ai.usage.completion_tokens": finished.num_completion_tokens,
            "kvloom.cached_tokens": finished.num_cached_tokens,
            "kvloom.num_preemptions": len(timeline.preempted_steps),
        }
        if live is not None:
            params = live.request.sampling_params
            attributes["gen_ai.request.max_tokens"] = live.request.max_tokens
            attributes["gen_ai.request.temperature"] = params.temperature
            attributes["gen_ai.request.top_p"] = params.top_p
        attributes.update(_latencies(timeline, finished_time, finished.num_completion_tokens))
        if finished.finish_reason is not None:
            attributes["kvloom.finish_reason"] = finished.finish_reason
        if finished.cache_miss_reason is not None:
            attributes["kvloom.cache_miss_reason"] = finished.cache_miss_reason
        if finished.error is not None:
            attributes["kvloom.error"] = finished.error
        span = self._tracer.start_span(SPAN_NAME, context=Context(), kind=SpanKind.SERVER,
                                       attributes=attributes, start_time=self._ns(timeline.arrival_time))
        span.add_event("queued", timestamp=self._ns(timeline.arrival_time))
        if timeline.first_scheduled_time is not None:
            span.add_event("scheduled", timestamp=self._ns(timeline.first_scheduled_time))
        if timeline.first_token_time is not None:
            span.add_event("first_token", timestamp=self._ns(timeline.first_token_time))
        preempted_at = live.preempted_at if live is not None else []
        for index, step in enumerate(timeline.preempted_steps):
            # Never seen alive (it came and went in one iteration): the finish is the best time left.
            at = preempted_at[index] if index < len(preempted_at) else finished_time
            span.add_event("preempted", {"scheduler.step": step}, timestamp=self._ns(at))
        span.add_event("finished", timestamp=self._ns(finished_time))
        if finished.error is not None:
            span.set_status(Status(StatusCode.ERROR, finished.error))
        span.end(end_time=self._ns(finished_time))

    def _ns(self, monotonic_s: float) -> int:
        return round(monotonic_s * 1e9) + self._epoch_offset_ns


def _from_output(output: RequestOutput) -> _Finished:
    completion = output.outputs[0] if output.outputs else None
    return _Finished(output.request_id, output.metrics, len(output.prompt_token_ids),
                     len(completion.token_ids) if completion is not None else 0,
                     output.num_cached_tokens, output.cache_miss_reason,
                     completion.finish_reason if completion is not None else None,
                     output.error.message if output.error is not None else None)


def _from_request(request: Request) -> _Finished:
    error = request.error.message if request.error is not None else None
    return _Finished(request.request_id, request.timeline, request.num_prompt_tokens,
                     request.num_output_tokens, request.num_cached_tokens, request.cache_miss_reason,
                     request.status.value, error)


def _latencies(timeline: RequestTimeline, finished_time: float, num_completion_tokens: int) -> dict[str, float]:
    """vLLM's gen_ai.latency.* (seconds), each only when both its ends happened."""
    arrival, scheduled = timeline.arrival_time, timeline.first_scheduled_time
    first, last = timeline.first_token_time, timeline.last_token_time
    latencies = {"gen_ai.latency.e2e": finished_time - arrival}
    if scheduled is not None:
        latencies["gen_ai.latency.time_in_queue"] = scheduled - arrival
    if first is not None:
        latencies["gen_ai.latency.time_to_first_token"] = first - arrival
    if scheduled is not None and first is not None:
        latencies["gen_ai.latency.time_in_model_prefill"] = first - scheduled
    if first is not None and last is not None:
        latencies["gen_ai.latency.time_in_model_decode"] = last - first
        if num_completion_tokens > 1:
            latencies["kvloom.latency.mean_inter_token"] = (last - first) / (num_completion_tokens - 1)
    if scheduled is not None and last is not None:
        latencies["gen_ai.latency.time_in_model_inference"] = last - scheduled
    return latencies
