"""Client disconnects abort their requests (blocks freed); /metrics parses and moves;
the engine thread sleeps when idle."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import SERVED_NAME, LiveServer, start_live_server

from kvloom.server.settings import ServerSettings


@pytest.fixture(scope="module")
def slow_server(tiny_llama) -> Iterator[LiveServer]:
    # 20 ms a step: a 200-token request lasts 4 s, far longer than a disconnect takes.
    live = start_live_server(tiny_llama, ServerSettings(served_model_name=SERVED_NAME),
                             step_delay=0.02)
    yield live
    live.stop()


LONG = {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 200, "ignore_eos": True}


def metric_samples(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    response = http.get("/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def aborted_count(http: httpx.Client) -> float:
    return metric_samples(http).get(
        ("kvloom:request_success_total", (("finished_reason", "abort"),)), 0.0)


@pytest.fixture
def slow_http(slow_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=slow_server.base_url, timeout=60) as client:
        yield client


def assert_aborted_promptly(server: LiveServer) -> None:
    """Idle and clean well before the 4 s the request would have run."""
    snapshot = server.wait_until(lambda s: s.num_running == 0 and s.num_active_requests == 0,
                                 timeout=2.0)
    assert snapshot.num_available_blocks == snapshot.num_blocks, snapshot
    server.assert_idle_and_clean()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", LONG),
    ("/v1/chat/completions", {"model": SERVED_NAME, "max_tokens": 200, "ignore_eos": True,
                              "messages": [{"role": "user", "content": "hi"}]}),
], ids=["completions", "chat"])
def test_disconnect_mid_stream_aborts(slow_server: LiveServer, slow_http: httpx.Client,
                                      path: str, body: dict) -> None:
    before = aborted_count(slow_http)
    with httpx.Client(base_url=slow_server.base_url, timeout=60) as client:
        with client.stream("POST", path, json={**body, "stream": True}) as response:
            lines = response.iter_lines()
            next(line for line in lines if '"finish_reason":null' in line)
            assert slow_server.snapshot().num_running == 1
    assert_aborted_promptly(slow_server)
    assert aborted_count(slow_http) == before + 1


def test_disconnect_while_waiting_for_full_response_aborts(slow_server: LiveServer,
                                                          slow_http: httpx.Client) -> None:
    before = aborted_count(slow_http)
    with httpx.Client(base_url=slow_server.base_url, timeout=httpx.Timeout(60, read=0.5)) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", json=LONG)
    assert_aborted_promptly(slow_server)
    assert aborted_count(slow_http) == before + 1


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 100, "n": 2,
                         "use_beam_search": True}),
    ("/v1/responses", {"model": SERVED_NAME, "input": "hello", "max_output_tokens": 200}),
], ids=["beam_search", "responses"])
def test_disconnect_while_waiting_ends_it_without_an_error(slow_server: LiveServer, slow_http: httpx.Client,
                                                           caplog: pytest.LogCaptureFixture, path: str,
                                                           body: dict) -> None:
    """A beam search's rounds stop (no next round is sent) and a response's request is
    aborted; nothing is logged as an error, and the next request is served."""
    with httpx.Client(base_url=slow_server.base_url, timeout=httpx.Timeout(60, read=0.5)) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post(path, json=body)
    assert_aborted_promptly(slow_server)
    assert not [record for record in caplog.records if record.levelname in ("ERROR", "CRITICAL")]
    short = {**body, "max_tokens": 2} if "prompt" in body else {**body, "max_output_tokens": 2}
    assert slow_http.post(path, json=short).status_code == 200


def test_metrics_parse_and_move(live_server: LiveServer, http: httpx.Client) -> None:
    before = metric_samples(http)
    required = ["kvloom:num_requests_running", "kvloom:num_requests_waiting",
                "kvloom:kv_cache_usage_perc", "kvloom:num_preemptions_total",
                "kvloom:prompt_tokens_total", "kvloom:generation_tokens_total",
                "kvloom:prefix_cache_queries_total", "kvloom:prefix_cache_hits_total",
                "kvloom:time_to_first_token_seconds_count", "kvloom:inter_token_latency_seconds_count",
                "kvloom:e2e_request_latency_seconds_count", "kvloom:request_queue_time_seconds_count",
                "kvloom:iteration_tokens_total_count"]
    names = {name for name, _ in before}
    assert not [name for name in required if name not in names]
    response = http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": "hello world",
                                                 "max_tokens": 4, "ignore_eos": True})
    usage = response.json()["usage"]
    after = metric_samples(http)

    def moved(name: str, labels: tuple = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert moved("kvloom:prompt_tokens_total") == usage["prompt_tokens"]
    assert moved("kvloom:generation_tokens_total") == 4
    assert moved("kvloom:request_success_total", (("finished_reason", "length"),)) == 1
    assert moved("kvloom:prefix_cache_queries_total") == usage["prompt_tokens"]
    assert moved("kvloom:prefix_cache_hits_total") == usage["prompt_tokens_details"]["cached_tokens"]
    assert moved("kvloom:time_to_first_token_seconds_count") == 1
    assert moved("kvloom:inter_token_latency_seconds_count") == 3
    assert moved("kvloom:e2e_request_latency_seconds_count") == 1
    assert after[("kvloom:num_requests_running", ())] == 0


class _Recorder:
    """A step observer (engine thread) that keeps each engine request's outputs and the
    tokens its progress reported."""

    def __init__(self) -> None:
        self.outputs: dict[str, list] = defaultdict(list)
        self.progress_tokens: dict[str, int] = defaultdict(int)

    def on_step(self, engine, outputs, progress, stats, now) -> None:
        for output in outputs:
            self.outputs[output.request_id].append(output)
        for entry in progress:
            self.progress_tokens[entry.request_id] += entry.num_new_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["full", "streamed"])
def test_outputs_per_step_only_where_streamed(live_server: LiveServer, http: httpx.Client, stream: bool) -> None:
    """A full response gets one output per choice, at its end (FINAL_ONLY); a streamed
    one an output per token that holds only that token (DELTA). Either way the metrics
    count every token, from the engine's progress, and usage is right."""
    recorder = _Recorder()
    live_server.async_engine.observers.append(recorder)
    try:
        before = metric_samples(http)
        body = {"model": SERVED_NAME, "prompt": "hello world", "max_tokens": 6, "n": 2, "ignore_eos": True,
                "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200
        if stream:
            events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: {")]
            response_id, usage = json.loads(events[0])["id"], json.loads(events[-1])["usage"]
        else:
            response_id, usage = response.json()["id"], response.json()["usage"]
        live_server.snapshot()  # a command the engine thread takes after the last step's observers ran
    finally:
        live_server.async_engine.observers.remove(recorder)
    ids = [f"{response_id}-{choice}" for choice in range(2)]
    assert sorted(recorder.outputs) == ids
    for request_id in ids:
        outputs = recorder.outputs[request_id]
        assert recorder.progress_tokens[request_id] == 6
        if stream:
            assert len(outputs) == 6
            assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].delta_token_ids for o in outputs]
            assert all(len(o.outputs[0].token_ids) == 1 for o in outputs)
        else:
            assert len(outputs) == 1 and outputs[0].finished and len(outputs[0].outputs[0].token_ids) == 6
    assert usage["completion_tokens"] == 12
    after = metric_samples(http)
    assert after[("kvloom:generation_tokens_total", ())] - before[("kvloom:generation_tokens_total", ())] == 12
    moved_itl = (after[("kvloom:inter_token_latency_seconds_count", ())]
                 - before[("kvloom:inter_token_latency_seconds_count", ())])
    assert moved_itl == 2 * 5


def _thread_cpu_ticks(thread: threading.Thread) -> int:
    fields = open(f"/proc/self/task/{thread.native_id}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_engine_thread_sleeps_when_idle(live_server: LiveServer) -> None:
    live_server.assert_idle_and_clean()
    thread = next(t for t in threading.enumerate() if t.name == "kvloom-engine"
                  and t is live_server.async_engine._thread)
    before = _thread_cpu_ticks(thread)
    time.sleep(0.5)  # a measurement window, not synchronisation
    assert _thread_cpu_ticks(thread) - before <= 1  # clock ticks (10 ms): no spinning
