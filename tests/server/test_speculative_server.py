"""Speculative decoding behind the OpenAI API: the same completions (streamed and
not, n > 1) as a server without it, and the speculative counters in /metrics and in
``kvloom bench``'s counter deltas."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from server_harness import SERVED_NAME, LiveServer, start_live_server

from kvloom.bench.metrics import counter_deltas, parse_prometheus
from kvloom.server.settings import ServerSettings

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick"


@pytest.fixture(scope="module")
def servers(tiny_llama) -> Iterator[tuple[LiveServer, LiveServer]]:
    settings = ServerSettings(served_model_name=SERVED_NAME)
    # bf16 (the default): a row's logits do not depend on its step's other rows.
    plain = start_live_server(tiny_llama, settings, dtype="bfloat16")
    speculative = start_live_server(tiny_llama, settings, dtype="bfloat16",
                                    speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    yield plain, speculative
    plain.stop()
    speculative.stop()


def complete(server: LiveServer, **body) -> dict:
    payload = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 40, "temperature": 0.0, **body}
    response = httpx.post(f"{server.base_url}/v1/completions", json=payload, timeout=60)
    response.raise_for_status()
    return response.json()


def streamed_text(server: LiveServer, **body) -> str:
    payload = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 40, "temperature": 0.0,
               "stream": True, **body}
    text = ""
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=payload, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":

                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_same_completions_streamed_or_not_and_counted(servers) -> None:
    plain, speculative = servers
    before = parse_prometheus(httpx.get(f"{speculative.base_url}/metrics").text)
    expected = complete(plain, logprobs=1)
    got = complete(speculative, logprobs=1)
    assert got["choices"][0]["text"] == expected["choices"][0]["text"]
    assert got["choices"][0]["logprobs"] == expected["choices"][0]["logprobs"]
    assert streamed_text(speculative) == expected["choices"][0]["text"]
    several = complete(speculative, n=3, temperature=0.8, seed=5)
    assert len(several["choices"]) == 3 and all(c["finish_reason"] for c in several["choices"])
    assert complete(speculative, n=3, temperature=0.8, seed=5)["choices"] == several["choices"]
    after = parse_prometheus(httpx.get(f"{speculative.base_url}/metrics").text)
    deltas = counter_deltas(before, after)
    assert deltas["kvloom:spec_decode_num_draft_tokens_total"] > 0
    accepted = deltas["kvloom:spec_decode_num_accepted_tokens_total"]
    assert deltas["kvloom:spec_decode_acceptance_rate"] == pytest.approx(
        accepted / deltas["kvloom:spec_decode_num_draft_tokens_total"])
    assert deltas["kvloom:spec_decode_mean_accepted_length"] == pytest.approx(
        1 + accepted / deltas["kvloom:spec_decode_num_drafts_total"])
    assert 0 <= after["kvloom:spec_decode_acceptance_rate"] <= 1
    assert after["kvloom:spec_decode_mean_accepted_length"] >= 1
    assert speculative.snapshot() is not None  # runs the integrity check on the engine thread
