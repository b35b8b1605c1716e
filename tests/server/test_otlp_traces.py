"""OpenTelemetry traces (``--otlp-traces-endpoint``, kvloom/server/tracing.py).

An OTLP/HTTP receiver runs in this process (the protobuf the real exporter sends,
parsed with the OTLP proto classes). A live server on the tiny model traces a cold
and a repeated long prompt (prefix-cache hit), a pair that a 6-block pool cannot hold
at once (one is preempted and recomputed) and a stream the client drops (aborted);
stopping the server closes the tracer, which flushes the batch. The spans must agree
with what the API reported (usage) and the engine counted (/metrics). Unit tests feed
the tracer hand-built requests and compare every number with a hand-computed one.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from server_harness import SERVED_NAME, start_live_server

from kvloom.engine.output import CompletionOutput, RequestOutput
from kvloom.request import Request, RequestError, RequestStatus
from kvloom.sampling_params import SamplingParams
from kvloom.server.settings import ServerSettings
from kvloom.server.tracing import RequestTracer

SPANS_DEADLINE_S = 10.0


# ---- an OTLP/HTTP receiver ---------------------------------------------------------------
@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]]  # (name, time_unix_nano, attributes)
    status_code: int
    status_message: str

    def event_time(self, name: str) -> int:
        (time_ns,) = [t for event, t, _ in self.events if event == name]
        return time_ns


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


class OtlpReceiver:
    """POST /v1/traces on a free loopback port; keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver.add(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def add(self, request: ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            service = _attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        service, span.name, span.kind, span.start_time_unix_nano, span.end_time_unix_nano,
                        _attributes(span.attributes),
                        [(e.name, e.time_unix_nano, _attributes(e.attributes)) for e in span.events],
                        span.status.code, span.status.message))
        with self.lock:
            self.spans.extend(received)

    def spans_of(self, service: str) -> list[ReceivedSpan]:
        with self.lock:
            return [span for span in self.spans if span.service == service]

    def wait_for(self, service: str, count: int) -> list[ReceivedSpan]:
        """The service's spans once ``count`` arrived (the flush at close should already
        have delivered them; the deadline only bounds a broken exporter)."""
        deadline = time.monotonic() + SPANS_DEADLINE_S
        while len(spans := self.spans_of(service)) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return spans

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    collector = OtlpReceiver()
    yield collector
    collector.close()


# ---- a live server with tracing on ----------------------------------------------------------
LONG_PROMPT = list(range(10, 90))  # 80 token ids: 4 full 16-token blocks to share
PAIR = [list(range(300, 312)), list(range(320, 332))]  # 12 + 50 tokens = 4 blocks each; 6 in the pool
PAIR_MAX_TOKENS = 50
DROPPED_MAX_TOKENS = 80


@dataclass
class Traced:
    spans: dict[str, ReceivedSpan]  # by gen_ai.request.id
    first: dict[str, Any]  # the API's answers
    repeat: dict[str, Any]
    pair: dict[str, Any]
    aborted_id: str
    num_preemptions: float  # kvloom:num_preemptions_total


def _completion(http: httpx.Client, prompt: Any, max_tokens: int) -> dict[str, Any]:
    response = http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _metric(http: httpx.Client, name: str) -> float:
    (line,) = [line for line in http.get("/metrics").text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


@pytest.fixture(scope="module")
def traced(tiny_llama: Path, receiver: OtlpReceiver) -> Traced:
    settings = ServerSettings(served_model_name=SERVED_NAME, otlp_traces_endpoint=receiver.endpoint)
    # 10 ms a step at least: the dropped stream's 80 tokens would take 0.8 s or more, far
    # longer than the disconnect takes to abort it.
    live = start_live_server(tiny_llama, settings, num_blocks=6, step_delay=0.01)
    try:
        with httpx.Client(base_url=live.base_url, timeout=60) as http:
            first = _completion(http, LONG_PROMPT, 8)
            repeat = _completion(http, LONG_PROMPT, 8)
            pair = _completion(http, PAIR, PAIR_MAX_TOKENS)
            with http.stream("POST", "/v1/completions", json={
                    "model": SERVED_NAME, "prompt": [5, 6, 7, 8], "max_tokens": DROPPED_MAX_TOKENS,
                    "ignore_eos": True, "stream": True}) as response:
                line = next(line for line in response.iter_lines() if line.startswith("data: {"))
                aborted_id = json.loads(line.removeprefix("data: "))["id"] + "-0"
            live.assert_idle_and_clean()
            num_preemptions = _metric(http, "kvloom:num_preemptions_total")
        assert live.async_engine.info is not None
    finally:
        live.stop()  # closes the tracer: the batch is exported before this returns
    spans = receiver.wait_for("kvloom", 5)
    by_id = {span.attributes["gen_ai.request.id"]: span for span in spans}
    assert len(by_id) == len(spans), "one span per request"
    return Traced(by_id, first, repeat, pair, aborted_id, num_preemptions)


def _engine_ids(answer: dict[str, Any]) -> list[str]:
    return [f"{answer['id']}-{choice['index']}" for choice in answer["choices"]]


def test_one_llm_request_span_per_request(traced: Traced) -> None:
    expected = {*_engine_ids(traced.first), *_engine_ids(traced.repeat), *_engine_ids(traced.pair),
                traced.aborted_id}
    assert set(traced.spans) == expected
    for span in traced.spans.values():
        assert (span.name, span.kind, span.service) == ("llm_request", Span.SPAN_KIND_SERVER, "kvloom")
        assert span.attributes["gen_ai.response.model"] == SERVED_NAME  # the name clients use
        assert span.status_code == Status.STATUS_CODE_UNSET


def test_token_counts_and_cache_hits_match_the_usage(traced: Traced) -> None:
    for answer in (traced.first, traced.repeat):
        (span,) = [traced.spans[i] for i in _engine_ids(answer)]
        usage = answer["usage"]
        assert span.attributes["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"] == len(LONG_PROMPT)
        assert span.attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 8
        assert span.attributes["kvloom.cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert span.attributes["kvloom.finish_reason"] == "length"
        assert span.attributes["gen_ai.request.max_tokens"] == 8
        assert span.attributes["gen_ai.request.temperature"] == 0.0
        assert span.attributes["gen_ai.request.top_p"] == 1.0
    (repeat,) = [traced.spans[i] for i in _engine_ids(traced.repeat)]
    assert repeat.attributes["kvloom.cached_tokens"] > 0
    pair = [traced.spans[i] for i in _engine_ids(traced.pair)]
    assert sum(span.attributes["gen_ai.usage.prompt_tokens"] for span in pair) == traced.pair["usage"]["prompt_tokens"]
    assert [span.attributes["gen_ai.usage.completion_tokens"] for span in pair] == [PAIR_MAX_TOKENS] * 2


def _seconds(span: ReceivedSpan, since: str, until: str) -> Any:
    """From one event to another, with the tolerance of rounding to nanoseconds."""
    return pytest.approx((span.event_time(until) - span.event_time(since)) / 1e9, abs=1e-6)


def test_events_are_ordered_and_agree_with_the_latencies(traced: Traced) -> None:
    assert len(traced.spans) == 5
    for span in traced.spans.values():
        names = [name for name, _, _ in span.events]
        assert names[:3] == ["queued", "scheduled", "first_token"] and names[-1] == "finished"
        assert set(names[3:-1]) <= {"preempted"}
        times = [t for _, t, _ in span.events]
        assert span.start_ns == times[0] <= times[1] <= times[2] <= times[-1] == span.end_ns
        assert all(times[2] <= t <= times[-1] for t in times[3:-1])  # a preemption is after the first token here
        assert span.start_ns < span.end_ns
        attributes = span.attributes
        # Events and latencies come from one timeline; ns rounding only.
        assert attributes["gen_ai.latency.time_in_queue"] == _seconds(span, "queued", "scheduled")
        assert attributes["gen_ai.latency.time_to_first_token"] == _seconds(span, "queued", "first_token")
        assert attributes["gen_ai.latency.e2e"] == _seconds(span, "queued", "finished")
        assert attributes["gen_ai.latency.time_in_model_prefill"] == _seconds(span, "scheduled", "first_token")
        assert attributes["gen_ai.latency.time_in_model_decode"] <= attributes["gen_ai.latency.e2e"]
        assert abs(span.start_ns - time.time_ns()) < 600e9  # epoch nanoseconds, not monotonic ones


def test_preemptions_are_counted_and_evented(traced: Traced) -> None:
    pair = [traced.spans[i] for i in _engine_ids(traced.pair)]
    counts = [span.attributes["kvloom.num_preemptions"] for span in pair]
    assert sum(counts) >= 1, "the pair did not fit the pool together: one must have been preempted"
    total = sum(span.attributes["kvloom.num_preemptions"] for span in traced.spans.values())
    assert total == traced.num_preemptions
    for span in pair:
        steps = [attrs["scheduler.step"] for name, _, attrs in span.events if name == "preempted"]
        assert len(steps) == span.attributes["kvloom.num_preemptions"]
        assert steps == sorted(steps) and all(isinstance(step, int) and step > 0 for step in steps)


def test_a_dropped_stream_is_traced_as_aborted(traced: Traced) -> None:
    span = traced.spans[traced.aborted_id]
    assert span.attributes["kvloom.finish_reason"] == "abort"
    assert span.attributes["gen_ai.usage.prompt_tokens"] == 4
    assert 1 <= span.attributes["gen_ai.usage.completion_tokens"] < DROPPED_MAX_TOKENS
    assert span.attributes["gen_ai.request.max_tokens"] == DROPPED_MAX_TOKENS


# ---- the tracer on hand-built requests ---------------------------------------------------
def _engine(requests: dict[str, Request]) -> Any:
    return SimpleNamespace(model_name="hand-built", scheduler=SimpleNamespace(requests=requests))


def _output(request: Request, finished: bool, reason: str | None = None,
            error: RequestError | None = None, cached: int = 0) -> RequestOutput:
    return RequestOutput(request.request_id, None, request.prompt_token_ids,
                         [CompletionOutput(0, "", list(request.output_token_ids), reason)],
                         finished=finished, num_cached_tokens=cached, metrics=request.timeline, error=error)


def test_an_unfinished_output_emits_nothing(receiver: OtlpReceiver) -> None:
    tracer = RequestTracer(receiver.endpoint, service_name="unit-unfinished")
    request = Request("r", [5] * 20, SamplingParams(max_tokens=4), arrival_time=100.0)
    request.timeline.first_scheduled_time = request.timeline.first_token_time = 100.5
    request.append_output_token(7)
    tracer.on_step(_engine({"r": request}), [_output(request, finished=False)], [],
                   SimpleNamespace(num_preemptions=0), 100.5)
    tracer.close()  # exports whatever was batched, synchronously
    assert receiver.spans_of("unit-unfinished") == []


def test_spans_match_hand_computed_timelines(receiver: OtlpReceiver) -> None:
    tracer = RequestTracer(receiver.endpoint, service_name="unit-timelines")
    done = Request("done", [5] * 20, SamplingParams(max_tokens=5, temperature=0.5, top_p=0.75), arrival_time=100.0)
    dropped = Request("dropped", [6] * 3, SamplingParams(max_tokens=9), arrival_time=100.0)
    failed = Request("failed", [7] * 2, SamplingParams(), arrival_time=100.0)
    for request in (done, dropped):
        request.timeline.first_scheduled_time = 100.5
    requests = {"done": done, "dropped": dropped}
    engine, stats = _engine(requests), SimpleNamespace(num_preemptions=0)

    tracer.on_step(engine, [], [], stats, 100.5)  # both seen alive; nothing finished
    done.timeline.preempted_steps.append(7)  # preempted at step 7, noticed after it at 102.0
    stats.num_preemptions = 1
    tracer.on_step(engine, [], [], stats, 102.0)
    # "failed" came and went within one iteration (never seen alive) with an error;
    # "done" finished; "dropped" was aborted: it leaves the scheduler with no output.
    failed.timeline.first_scheduled_time, failed.timeline.finished_time = 100.25, 100.75
    for token in range(5):
        done.append_output_token(token)
    done.timeline.first_token_time, done.timeline.last_token_time = 101.0, 103.0
    done.timeline.finished_time = 103.25
    dropped.append_output_token(1)
    dropped.append_output_token(2)
    dropped.timeline.first_token_time, dropped.timeline.last_token_time = 101.0, 101.5
    dropped.timeline.finished_time, dropped.status = 102.5, RequestStatus.FINISHED_ABORTED
    requests.clear()
    tracer.on_step(engine, [_output(done, True, "length", cached=16),
                            _output(failed, True, "error", RequestError("boom"))], [], stats, 103.5)
    tracer.close()
    spans = {span.attributes["gen_ai.request.id"]: span for span in receiver.wait_for("unit-timelines", 3)}
    assert set(spans) == {"done", "failed", "dropped"}

    s = spans["done"]
    # Epoch time of monotonic 100.0 (the offset is taken at construction; 1 s of slack).
    assert abs(s.start_ns - (time.time_ns() - time.monotonic_ns() + 100_000_000_000)) < 1e9
    assert s.end_ns - s.start_ns == 3_250_000_000
    assert [(name, t - s.start_ns, attrs) for name, t, attrs in s.events] == [
        ("queued", 0, {}), ("scheduled", 500_000_000, {}), ("first_token", 1_000_000_000, {}),
        ("preempted", 2_000_000_000, {"scheduler.step": 7}), ("finished", 3_250_000_000, {})]
    assert s.attributes == {
        "gen_ai.request.id": "done", "gen_ai.response.model": "hand-built",
        "gen_ai.usage.prompt_tokens": 20, "gen_ai.usage.completion_tokens": 5,
        "gen_ai.request.max_tokens": 5, "gen_ai.request.temperature": 0.5, "gen_ai.request.top_p": 0.75,
        "gen_ai.latency.time_in_queue": 0.5, "gen_ai.latency.time_to_first_token": 1.0,
        "gen_ai.latency.e2e": 3.25, "gen_ai.latency.time_in_model_prefill": 0.5,
        "gen_ai.latency.time_in_model_decode": 2.0, "gen_ai.latency.time_in_model_inference": 2.5,
        "kvloom.latency.mean_inter_token": 0.5,  # 2.0 s over the 4 gaps between 5 tokens
        "kvloom.cached_tokens": 16, "kvloom.num_preemptions": 1, "kvloom.finish_reason": "length"}
    assert s.status_code == Status.STATUS_CODE_UNSET

    s = spans["failed"]  # never seen alive: no sampling attributes
    assert s.end_ns - s.start_ns == 750_000_000
    assert [(name, t - s.start_ns) for name, t, _ in s.events] == [
        ("queued", 0), ("scheduled", 250_000_000), ("finished", 750_000_000)]
    assert "gen_ai.request.max_tokens" not in s.attributes
    assert s.attributes["kvloom.finish_reason"] == "error" and s.attributes["kvloom.error"] == "boom"
    assert s.attributes["gen_ai.usage.completion_tokens"] == 0
    assert (s.status_code, s.status_message) == (Status.STATUS_CODE_ERROR, "boom")

    s = spans["dropped"]
    assert s.end_ns - s.start_ns == 2_500_000_000
    assert s.attributes["kvloom.finish_reason"] == "abort"
    assert (s.attributes["gen_ai.usage.prompt_tokens"], s.attributes["gen_ai.usage.completion_tokens"]) == (3, 2)
    assert s.attributes["gen_ai.request.max_tokens"] == 9
    assert s.attributes["gen_ai.latency.time_in_model_decode"] == 0.5
