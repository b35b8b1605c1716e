"""`bench interference`: the windowed analysis on hand-made timelines, and the client
against a fake OpenAI server that streams decodes until the client closes them."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from dataclasses import asdict
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fake_openai_server import MODEL_ID, FakeServer, FakeState, Handler

from kvloom.bench.interference import (
    FIRST_ID,
    InterferenceConfig,
    Stream,
    analyse,
    format_report,
    random_prompts,
    run_interference,
    transfer_counters,
)
from kvloom.bench.metrics import RequestRecord
from kvloom.cli import main

DELAY = 0.005  # seconds between the fake server's tokens
KV_BYTES_PER_REQUEST = 1000.0


def _stream(kind: str, sent_at: float, ttft: float, itl: list[float], output_len: int = 0,
            error: str | None = None) -> Stream:
    record = RequestRecord(0, 8, output_len=output_len, ttft=ttft, itl=itl, e2e=ttft + sum(itl), error=error)
    return Stream(kind, record, sent_at)


def test_random_prompts_are_distinct_and_in_range() -> None:
    prompts = random_prompts([4] * 30 + [50] * 5, 200, random.Random(1))
    assert [len(p) for p in prompts] == [4] * 30 + [50] * 5
    assert len({p[0] for p in prompts}) == 35  # no two share a first token, so no cached block
    assert all(FIRST_ID <= token < 200 for p in prompts for token in p)
    assert random_prompts([4, 4], 200, random.Random(1)) == random_prompts([4, 4], 200, random.Random(1))
    with pytest.raises(ValueError, match="vocab_size"):
        InterferenceConfig("http://x", decodes=60, num_prompts=60, vocab_size=200)


def test_analysis_counts_only_the_window() -> None:
    # Token times: a at 1, 2, ..., 7; b at 1.5, 2.5, 5.5, 6, 6.5.
    a = _stream("decode", 0.0, 1.0, [1.0] * 6)
    b = _stream("decode", 0.0, 1.5, [1.0, 3.0, 0.5, 0.5])
    # The window: from the first long prompt's send (3) to the last one's end (6).
    first = _stream("prompt", 3.0, 1.0, [1.0], output_len=2)  # tokens at 4, 5
    second = _stream("prompt", 4.0, 1.5, [0.5], output_len=3)  # usage says 3 (one event held two)
    result = analyse([a, b], [first, second], streaming_at=1.5)
    assert result["window_s"] == 3.0 and result["baseline_s"] == 1.5
    # In (3, 6]: a's gaps ending at 4, 5, 6 and b's ending at 5.5 and 6.
    itl = result["decode_itl_ms"]
    assert itl["count"] == 5 and itl["max"] == 3000.0 and itl["median"] == 1000.0
    assert itl["mean"] == pytest.approx(1e3 * 6.5 / 5)
    # The baseline: gaps with both tokens in [1.5, 3]: a's 2 -> 3 and b's 1.5 -> 2.5.
    assert result["decode_itl_baseline_ms"]["count"] == 2 and result["decode_itl_baseline_ms"]["max"] == 1000.0
    assert result["window_output_tokens"] == {"decode": 3 + 2, "prompt": 2 + 3}
    assert result["output_throughput_tok_s"] == 10 / 3.0
    ttft = result["prompt_ttft_ms"]
    assert ttft["count"] == 2 and ttft["mean"] == 1250.0 and result["prompt_e2e_ms"]["mean"] == 2000.0
    assert result["counts"] == {"decodes": 2, "decodes_streaming": 2, "decodes_failed": 0,
                                "decodes_ended_early": 0, "prompts": 2, "prompts_completed": 2,
                                "prompts_failed": 0}


def test_analysis_counts_failures_and_early_ends() -> None:
    decode = _stream("decode", 0.0, 1.0, [1.0] * 3)
    decode.ended_by_server = True  # finished before the client closed it
    failed = _stream("decode", 0.0, 1.0, [], error="HTTP 500: boom")
    failed.ended_by_server = True  # a failed request's task is done too
    ok = _stream("prompt", 2.0, 1.0, [], output_len=1)
    broken = _stream("prompt", 2.5, 1.0, [0.5], output_len=0, error="stream ended before the response finished")
    result = analyse([decode, failed], [ok, broken], streaming_at=1.0)
    counts = result["counts"]
    assert counts["decodes_streaming"] == 1 and counts["decodes_failed"] == 1 and counts["decodes_ended_early"] == 2
    assert counts["prompts_completed"] == 1 and counts["prompts_failed"] == 1
    assert result["window_output_tokens"]["prompt"] == 1 + 2  # a failed stream's tokens are its events
    assert result["prompt_ttft_ms"]["count"] == 1 and result["errors"] == {
        "HTTP 500: boom": 1, "stream ended before the response finished": 1}
    report = format_report({**result, "parameters": asdict(InterferenceConfig("http://x")), "transfer_counters": {}})
    assert "error x1: HTTP 500: boom" in report and "raise --decode-output-len" in report


def test_transfer_counters() -> None:
    before = {"kvloom:kv_transfer_bytes_total": 100.0, "kvloom:kv_transfer_seconds_total": 1.0, "x": 1.0}
    after = {"kvloom:kv_transfer_bytes_total": 500.0, "kvloom:kv_transfer_seconds_total": 1.0, "x": 9.0,
             "kvloom:kv_transfer_bytes_created": 5.0}
    assert transfer_counters(before, after, 4) == {"kvloom:kv_transfer_bytes_total": {"delta": 400.0,
                                                                                     "per_prompt": 100.0}}
    assert transfer_counters(None, after, 4) == {}


# ---------------------------------------------------------------- against a fake server
class _TokenHandler(Handler):
    """Completions of token-id prompts: one token every DELAY up to max_tokens, then usage;
    a decode (max_tokens > 100) streams until the client goes away."""

    def do_GET(self) -> None:
        if self.path != "/metrics":
            super().do_GET()
            return
        with self.server.state.lock:
            streamed = self.server.state.streamed
        self._send_json(200, f"kvloom:kv_transfer_bytes_total {KV_BYTES_PER_REQUEST * streamed}\n", "text/plain")

    def _respond(self, payload: dict[str, Any]) -> None:
        state = self.server.state
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with state.lock:
            state.streamed += 1
        max_tokens = payload["max_tokens"]
        for index in range(max_tokens):
            if state.stopped.wait(DELAY):
                return
            last = index == max_tokens - 1
            self._event({"choices": [{"index": 0, "text": "t", "finish_reason": "length" if last else None}],
                         "usage": None})
        self._event({"choices": [], "usage": {"prompt_tokens": len(payload["prompt"]),
                                              "completion_tokens": max_tokens}})
        self._event("[DONE]")
        self._chunk("")


class _TokenServer(FakeServer):
    def __init__(self) -> None:
        ThreadingHTTPServer.__init__(self, ("127.0.0.1", 0), _TokenHandler)
        self.state = FakeState(DELAY, metrics=True)


@pytest.fixture
def server() -> Iterator[FakeServer]:
    fake = _TokenServer().start_in_thread()
    yield fake
    fake.stop()


def _config(server: FakeServer, **kwargs: Any) -> InterferenceConfig:
    values: dict[str, Any] = dict(decodes=3, decode_prompt_len=8, decode_output_len=5000, num_prompts=4,
                                  prompt_len=50, prompt_output_len=3, request_rate=float("inf"),
                                  vocab_size=1000, baseline_s=0.0)
    return InterferenceConfig(server.base_url, **(values | kwargs))


def test_run_against_a_fake_server(server: FakeServer) -> None:
    result = asyncio.run(run_interference(_config(server), command="test"))
    assert result["model"] == MODEL_ID and result["errors"] == {}
    assert result["counts"] == {"decodes": 3, "decodes_streaming": 3, "decodes_failed": 0,
                                "decodes_ended_early": 0, "prompts": 4, "prompts_completed": 4,
                                "prompts_failed": 0}
    assert result["window_output_tokens"]["prompt"] == 4 * 3  # the usage of each long prompt
    # The fake counts a transfer per streamed request; the scrapes bracket the four long prompts.
    assert result["transfer_counters"] == {"kvloom:kv_transfer_bytes_total": {
        "delta": 4 * KV_BYTES_PER_REQUEST, "per_prompt": KV_BYTES_PER_REQUEST}}
    payloads = [r["payload"] for r in server.state.requests if r["path"] == "/v1/completions"]
    decodes, prompts = payloads[:3], payloads[3:]
    assert [len(p["prompt"]) for p in decodes] == [8] * 3 and [len(p["prompt"]) for p in prompts] == [50] * 4
    assert [p["max_tokens"] for p in payloads] == [5000] * 3 + [3] * 4
    assert len({p["prompt"][0] for p in payloads}) == 7
    assert all(FIRST_ID <= token < 1000 for p in payloads for token in p["prompt"])
    assert all(p["ignore_eos"] and p["temperature"] == 0.0 and p["stream_options"] == {"include_usage": True}
               for p in payloads)
    # Every long prompt was sent after every decode had its second token (the run waits for it).
    streams = result["streams"]
    second_tokens = [s["sent_at"] + s["ttft"] + s["itl"][0] for s in streams if s["kind"] == "decode"]
    assert min(s["sent_at"] for s in streams if s["kind"] == "prompt") >= max(second_tokens)
    # The window's decode tokens are those the recorded streams hold between its ends.
    start = min(s["sent_at"] for s in streams if s["kind"] == "prompt")
    end = max(s["sent_at"] + s["e2e"] for s in streams if s["kind"] == "prompt")
    assert end - start == pytest.approx(result["window_s"])
    in_window = 0
    for s in streams[:3]:
        times = [s["sent_at"] + s["ttft"]]
        for gap in s["itl"]:
            times.append(times[-1] + gap)
        in_window += sum(start < t <= end for t in times)
    assert result["window_output_tokens"]["decode"] == in_window
    assert "Interference Benchmark Result" in format_report(result)


def test_cli_writes_the_result(server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "interference.json"
    code = main(["bench", "interference", "--base-url", server.base_url, "--decodes", "2", "--num-prompts", "2",
                 "--prompt-len", "20", "--prompt-output-len", "2", "--request-rate", "inf", "--vocab-size", "500",
                 "--baseline-seconds", "0", "--result-json", str(out)])
    assert code == 0 and "Long prompts completed / failed:" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["kvloom_bench"] == "interference" and result["counts"]["prompts_completed"] == 2
    assert result["parameters"]["request_rate"] == "inf"  # strict JSON: no Infinity
    assert len(result["streams"]) == 4
