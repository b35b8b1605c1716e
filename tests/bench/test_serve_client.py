"""The streaming client and the run loop, against a fake OpenAI SSE server."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_openai_server import MODEL_ID, FakeServer

from kvloom.bench.arrivals import arrival_offsets, inter_arrival_gaps
from kvloom.bench.datasets import BenchRequest
from kvloom.bench.metrics import RequestRecord
from kvloom.bench.serve import (
    CHAT,
    COMPLETIONS,
    ServeBenchConfig,
    build_payload,
    report,
    run_benchmark,
    send_request,
    with_replies,
    workload_fingerprint,
)

DELAY = 0.03  # seconds between the fake server's chunks


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    server = FakeServer(delay=DELAY).start_in_thread()
    yield server
    server.stop()


def _send(server: FakeServer, prompt: str, endpoint: str = COMPLETIONS) -> RequestRecord:
    config = ServeBenchConfig(server.base_url, endpoint=endpoint)
    payload = build_payload(BenchRequest(prompt, 3, 8), config, MODEL_ID)

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(timeout=10) as client:
            return await send_request(client, f"{server.base_url}{endpoint}", payload,
                                      RequestRecord(0, 3))
    return asyncio.run(go())


def _run(server: FakeServer, requests: list[BenchRequest], **kwargs: Any) -> dict[str, Any]:
    config = ServeBenchConfig(server.base_url, show_progress=False, **kwargs)
    return asyncio.run(run_benchmark(config, requests, command="test"))


def test_completion_stream_timing_and_usage(fake: FakeServer) -> None:
    record = _send(fake, "hello there world")
    assert record.success, record.error
    assert record.usage_reported and record.output_len == 3 and record.server_prompt_tokens == 3
    assert record.ttft is not None and record.ttft >= DELAY * 0.8
    assert len(record.itl) == 2 and all(gap >= DELAY * 0.8 for gap in record.itl)
    assert record.e2e is not None and record.e2e >= record.ttft + sum(record.itl) - 1e-6
    assert record.tpot == pytest.approx((record.e2e - record.ttft) / 2)


def test_chat_role_chunk_is_not_the_first_token(fake: FakeServer) -> None:
    record = _send(fake, "hi", endpoint=CHAT)
    assert record.success, record.error
    # The role-only chunk arrives at once; the first content one DELAY later.
    assert record.ttft is not None and record.ttft >= DELAY * 0.8
    assert len(record.itl) == 2 and record.output_len == 3
    payload = fake.state.requests[-1]["payload"]
    assert payload["messages"] == [{"role": "user", "content": "hi"}]
    assert payload["stream"] is True and payload["stream_options"] == {"include_usage": True}


def test_without_usage_the_text_chunks_are_counted(fake: FakeServer) -> None:
    record = _send(fake, "nousage")
    assert record.success and not record.usage_reported
    assert record.output_len == 3 and record.server_prompt_tokens is None


def test_usage_wins_over_chunk_count(fake: FakeServer) -> None:
    record = _send(fake, "multitoken")
    assert record.success and record.output_len == 5 and len(record.itl) == 1
    assert record.tpot == pytest.approx((record.e2e - record.ttft) / 4)


@pytest.mark.parametrize("prompt, expected", [
    ("error500", "HTTP 500: boom"), ("bad400", "HTTP 400: bad request"),
    ("disconnect", "RemoteProtocolError"), ("streamerror", "stream error: oops"),
    ("truncated", "stream ended before the response finished")])
def test_failures_are_recorded_not_raised(fake: FakeServer, prompt: str, expected: str) -> None:
    record = _send(fake, prompt)
    assert not record.success and expected in (record.error or "")
    assert record.e2e is not None


def test_connection_refused_is_a_failed_request() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before the request: nobody listens

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(timeout=5) as client:
            return await send_request(client, f"http://127.0.0.1:{port}/v1/completions",
                                      {"prompt": "x"}, RequestRecord(0, 1))
    record = asyncio.run(go())
    assert not record.success and "ConnectError" in (record.error or "")


def test_payload_fields() -> None:
    request = BenchRequest("text", 1, 16)
    payload = build_payload(request, ServeBenchConfig("http://x"), "m")
    assert payload == {"model": "m", "max_tokens": 16, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}, "prompt": "text"}
    extra = build_payload(request, ServeBenchConfig("http://x", ignore_eos=True,
                                                    extra_body={"top_k": 5}), "m")
    assert extra["ignore_eos"] is True and extra["top_k"] == 5
    with pytest.raises(ValueError, match="chat"):
        chat_request = BenchRequest([{"role": "user", "content": "q"}], 1, 4)
        build_payload(chat_request, ServeBenchConfig("http://x"), "m")
    with pytest.raises(ValueError, match="endpoint"):
        ServeBenchConfig("http://x", endpoint="/v1/embeddings")


def test_run_counts_failures_and_scrapes_counter_deltas(fake: FakeServer) -> None:
    prompts = ["ok one", "ok two", "ok three", "ok four", "error500", "bad400", "disconnect"]
    requests = [BenchRequest(p, 2, 3) for p in prompts]
    result = _run(fake, requests, num_warmups=2, slo={"ttft": 10_000.0})
    metrics = result["metrics"]
    assert (metrics["completed"], metrics["failed"]) == (4, 3)
    assert metrics["total_output_tokens"] == 12 and metrics["total_input_tokens"] == 8
    assert metrics["goodput"] == pytest.approx(4 / metrics["duration_s"])
    assert sum(metrics["errors"].values()) == 3
    assert result["model"] == MODEL_ID  # resolved from /v1/models
    assert result["warmup_failures"] == 0 and len(fake.state.requests) == 2 + 7
    # Five streamed requests in the timed run (two failed ones never streamed); the
    # warm-ups streamed before the first scrape and do not count.
    counters = result["server_counters"]
    assert counters["kvloom:prefix_cache_hits_total"] == 50
    assert counters["kvloom:prefix_cache_queries_total"] == 200
    assert counters["kvloom:prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert counters["kvloom:num_preemptions_total"] == 7 // 2 - 2 // 2
    assert counters["vllm:prefix_cache_hits_total"] == 5
    assert not any("created" in name or "running" in name for name in counters)
    records = result["requests"]
    assert [r["index"] for r in records] == list(range(7))
    assert all(set(r) >= {"prompt_len", "output_len", "ttft", "itl", "e2e", "error"} for r in records)
    json.dumps(result, allow_nan=False)  # strict JSON: no Infinity or NaN
    assert "Failed requests:" in report(result)


def test_no_metrics_endpoint_means_no_counters() -> None:
    server = FakeServer(delay=0.001, metrics=False).start_in_thread()
    try:
        result = _run(server, [BenchRequest("ok", 1, 3)], model="explicit")
    finally:
        server.stop()
    assert result["server_counters"] == {} and result["metrics"]["completed"] == 1
    assert server.state.requests[0]["payload"]["model"] == "explicit"


def test_max_concurrency_caps_in_flight_requests(fake: FakeServer) -> None:
    result = _run(fake, [BenchRequest(f"ok {i}", 2, 3) for i in range(6)], max_concurrency=2)
    assert result["metrics"]["completed"] == 6 and fake.state.max_in_flight == 2


def test_request_rate_paces_sends_by_the_seeded_schedule(fake: FakeServer) -> None:
    fake.state.delay = 0.001
    result = _run(fake, [BenchRequest(f"ok {i}", 2, 3) for i in range(8)], request_rate=40.0, seed=5)
    planned = arrival_offsets(inter_arrival_gaps(8, 40.0, seed=5))
    actual = [r["start_time"] for r in result["requests"]]
    # Never early (that is what pacing guarantees); how late depends on the machine's
    # load, so it is not asserted (tests/bench/test_arrivals.py checks the schedule on a
    # simulated clock).
    for sent, scheduled in zip(actual, planned, strict=True):
        assert sent >= scheduled - 0.002
    assert actual == sorted(actual)
    assert result["parameters"]["request_rate"] == 40.0


def test_multiturn_sends_turns_in_order_and_conversations_concurrently(fake: FakeServer) -> None:
    requests = []
    for group in range(2):
        history: list[dict[str, str]] = []
        for turn in range(3):
            history = history + [{"role": "user", "content": f"conv {group} turn {turn}"}]
            requests.append(BenchRequest(list(history), 4, 3, group=group, turn=turn))
            history = history + [{"role": "assistant", "content": "reply"}]
    fake.state.rendezvous, fake.state.rendezvous_left = threading.Barrier(2), 2  # the first turns meet
    result = _run(fake, requests, endpoint=CHAT)
    assert result["metrics"]["completed"] == 6
    assert set(result["metrics"]["ttft_ms_by_turn"]) == {0, 1, 2}
    seen = {r["payload"]["messages"][-1]["content"]: r for r in fake.state.requests}
    for group in range(2):
        for turn in range(2):
            previous, following = seen[f"conv {group} turn {turn}"], seen[f"conv {group} turn {turn + 1}"]
            assert following["start"] >= previous["end"]
    assert fake.state.max_in_flight == 2  # the two conversations overlap
    assert [r["turn"] for r in result["requests"]] == [0, 1, 2, 0, 1, 2]
    # By default the history is the dataset's: every engine is sent the same prompts.
    assert [m["content"] for m in seen["conv 1 turn 2"]["payload"]["messages"]] == [
        "conv 1 turn 0", "reply", "conv 1 turn 1", "reply", "conv 1 turn 2"]


def _conversations(turns: int, prompt_len: int) -> list[BenchRequest]:
    requests = []
    for group in range(2):
        history: list[dict[str, str]] = []
        for turn in range(turns):
            history = history + [{"role": "user", "content": f"conv {group} turn {turn}"}]
            requests.append(BenchRequest(list(history), prompt_len, 3, group=group, turn=turn))
            history = history + [{"role": "assistant", "content": "the dataset's reply"}]
    return requests


def test_multiturn_with_generated_history_sends_the_servers_own_replies(fake: FakeServer) -> None:
    result = _run(fake, _conversations(3, 99), endpoint=CHAT, history="generated")
    assert result["metrics"]["completed"] == 6
    seen = {r["payload"]["messages"][-1]["content"]: r["payload"]["messages"] for r in fake.state.requests}
    for group in range(2):
        # The fake streams "a", "b", "c" for each of them: a chat client's history.
        assert [m["content"] for m in seen[f"conv {group} turn 2"]] == [
            f"conv {group} turn 0", "abc", f"conv {group} turn 1", "abc", f"conv {group} turn 2"]
        assert [m["role"] for m in seen[f"conv {group} turn 1"]] == ["user", "assistant", "user"]
    # The prompt sent is not the dataset's: its length is the server's count (the fake's:
    # the last message's words), not the 99 the dataset gave.
    assert [r["prompt_len"] for r in result["requests"]] == [4] * 6
    assert result["parameters"]["history"] == "generated"


def test_history_must_be_dataset_or_generated() -> None:
    with pytest.raises(ValueError, match="history must be one of dataset, generated"):
        ServeBenchConfig("http://x", history="model")
    with pytest.raises(ValueError, match="earlier replies"):
        with_replies(_conversations(2, 4)[1], ["one", "two"])
    with pytest.raises(ValueError, match="chat-message prompts"):
        with_replies(BenchRequest("text", 1, 1), [])


def test_fingerprint_tracks_requests_and_parameters() -> None:
    requests = [BenchRequest("a", 1, 2), BenchRequest([{"role": "user", "content": "b"}], 1, 2, 0, 0)]
    params = ServeBenchConfig("http://x", request_rate=math.inf).load_parameters()
    assert params["request_rate"] == "inf"
    same = workload_fingerprint(list(requests), dict(params))
    assert same == workload_fingerprint(requests, params)
    assert same != workload_fingerprint(requests[:1], params)
    assert same != workload_fingerprint(requests, {**params, "seed": 1})
    # The server is not part of the workload: other base URLs, same fingerprint.
    assert ServeBenchConfig("http://y").load_parameters() == ServeBenchConfig("http://x").load_parameters()
    # Generated history sends other prompts; the default leaves earlier fingerprints as they were.
    assert "history" not in params
    generated = ServeBenchConfig("http://x", request_rate=math.inf, history="generated").load_parameters()
    assert workload_fingerprint(requests, generated) != same


def test_an_interrupted_run_reports_the_requests_that_finished(fake: FakeServer) -> None:
    """Ctrl-C (asyncio.run cancels the run) while the fourth request hangs: the result
    holds the three that finished, says so, and the report is printed from them."""
    requests = [BenchRequest(f"p{i} x", 2, 3) for i in range(3)] + [BenchRequest("hang", 1, 3)]
    config = ServeBenchConfig(fake.base_url, show_progress=False, max_concurrency=1, num_warmups=0)

    async def interrupted() -> dict[str, Any]:
        run = asyncio.create_task(run_benchmark(config, requests, command="test"))
        # One at a time: the hanging request is sent only once the other three are done.
        await asyncio.get_running_loop().run_in_executor(None, fake.state.hanging.wait, 30)
        run.cancel()  # what asyncio.run does on Ctrl-C
        return await run

    result = asyncio.run(interrupted())
    assert result["interrupted"] == {"finished": 3, "of": 4}
    assert result["metrics"]["completed"] == 3 and result["metrics"]["failed"] == 0
    assert [r["index"] for r in result["requests"]] == [0, 1, 2]
    assert "INTERRUPTED: the 3 of 4 requests that finished" in report(result)
