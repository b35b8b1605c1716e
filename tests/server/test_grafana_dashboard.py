"""examples/grafana/kvloom.json queries only series a live server exposes, each with a
PromQL function that suits its type; the per-request histograms it charts hold values
checked by hand against what the API answered."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import SERVED_NAME, LiveServer

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "kvloom.json"
METRIC = re.compile(r"kvloom:[A-Za-z0-9_:]+")
RATED = re.compile(r"\b(?:rate|increase|irate)\(\s*(kvloom:[A-Za-z0-9_:]+)")
HISTOGRAM_PARTS = ("_bucket", "_sum", "_count")
BLOCK_SIZE = 16  # server_harness.ENGINE_KWARGS

Samples = dict[tuple[str, tuple], float]


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def graph_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [panel for panel in dashboard["panels"] if panel["type"] != "row"]


def exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query."""
    return [(panel["title"], target["expr"]) for panel in graph_panels(dashboard)
            for target in panel["targets"]]


def scrape(http: httpx.Client) -> tuple[Samples, dict[str, str]]:
    """The /metrics text: every sample by (name, labels), and each sample name's family type."""
    response = http.get("/metrics")
    assert response.status_code == 200
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
            types[sample.name] = family.type
    return samples, types


def complete(http: httpx.Client, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    response = http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": prompt,
                                                 "max_tokens": max_tokens, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


# ---- the dashboard file -------------------------------------------------------------
def test_dashboard_parses_and_has_panels() -> None:
    dashboard = load_dashboard()
    panels = graph_panels(dashboard)
    assert len(panels) >= 15 and all(panel["type"] == "timeseries" and panel["targets"] for panel in panels)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for panel in panels:
        sources = [panel["datasource"], *(target["datasource"] for target in panel["targets"])]
        assert all(source == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"} for source in sources), \
            panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
    titles = {panel["title"] for panel in panels}
    assert {"Token throughput", "Requests running / waiting", "KV cache usage", "Prefix cache hit rate",
            "Preemptions", "Finished requests by reason", "Time to first token", "Inter-token latency",
            "End-to-end request latency", "Queue time", "Prefill time", "Decode time",
            "Iteration tokens", "Prompt length", "Generation length"} <= titles


def test_quantiles_come_from_buckets_summed_by_le() -> None:
    for title, expr in exprs(load_dashboard()):
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), (title, expr)
        if "histogram_quantile" in expr:
            # Without "by (le)" the sum drops the bucket label and the quantile is NaN.
            assert re.fullmatch(r"histogram_quantile\(0\.\d+, sum by \(le\) \(rate\(kvloom:[\w:]+_bucket"
                                r"\{[^}]*\}\[\$__rate_interval\]\)\)\)", expr), (title, expr)
        else:
            assert "_bucket" not in expr, (title, expr)


# ---- against a live server ----------------------------------------------------------
def test_every_queried_series_is_exposed_with_a_fitting_type(live_server: LiveServer,
                                                             http: httpx.Client) -> None:
    # A finished request makes the labelled series (request_success by reason) appear.
    complete(http, "hello", max_tokens=2)
    samples, types = scrape(http)
    missing, misused = [], []
    for title, expr in exprs(load_dashboard()):
        rated = RATED.findall(expr)
        for name in METRIC.findall(expr):
            kind = types.get(name)
            if kind is None:
                missing.append((title, name))
            elif name in rated:
                # rate() of a gauge is meaningless: only counters and histogram parts grow.
                ok = kind == "counter" and name.endswith("_total") or \
                    kind == "histogram" and name.endswith(HISTOGRAM_PARTS)
                if not ok:
                    misused.append((title, name, kind))
            elif kind != "gauge":
                # A counter or histogram read raw only ever grows: it needs rate().
                misused.append((title, name, kind))
    assert not missing, missing
    assert not misused, misused
    assert samples[("kvloom:request_success_total", (("finished_reason", "length"),))] >= 1


def test_request_histograms_hold_hand_checked_values(live_server: LiveServer, http: httpx.Client) -> None:
    num_requests, max_tokens = 3, 4
    before, _ = scrape(http)
    usages, client_seconds = [], 0.0
    for prompt in ("hello", "hello world", "the quick brown fox"):
        # The server runs in this process: its monotonic clock is ours, and a request's
        # arrival-to-finish lies inside the client's send-to-answer.
        start = time.monotonic()
        usages.append(complete(http, prompt, max_tokens)["usage"])
        client_seconds += time.monotonic() - start
    after, _ = scrape(http)

    def moved(name: str, labels: tuple = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert [usage["completion_tokens"] for usage in usages] == [max_tokens] * num_requests
    prompt_lengths = [usage["prompt_tokens"] for usage in usages]
    assert moved("kvloom:request_generation_tokens_count") == num_requests
    assert moved("kvloom:request_generation_tokens_sum") == num_requests * max_tokens
    # Buckets are cumulative: 4 tokens fall in le=5, none in le=2.
    assert moved("kvloom:request_generation_tokens_bucket", (("le", "2.0"),)) == 0
    assert moved("kvloom:request_generation_tokens_bucket", (("le", "5.0"),)) == num_requests
    assert moved("kvloom:request_prompt_tokens_count") == num_requests
    assert moved("kvloom:request_prompt_tokens_sum") == sum(prompt_lengths)
    for le in (1.0, 2.0, 5.0, 10.0, 20.0):
        assert moved("kvloom:request_prompt_tokens_bucket", (("le", str(le)),)) == \
            sum(length <= le for length in prompt_lengths), le

    phases = {name: moved(f"kvloom:{name}_seconds_sum") for name in
              ("request_prefill_time", "request_decode_time", "request_inference_time",
               "e2e_request_latency", "request_queue_time")}
    for name in phases:
        assert moved(f"kvloom:{name}_seconds_count") == num_requests, name
    prefill, decode, inference = (phases[name] for name in
                                  ("request_prefill_time", "request_decode_time", "request_inference_time"))
    e2e, queue = phases["e2e_request_latency"], phases["request_queue_time"]
    # A forward pass lies between first scheduled and first token, three more between
    # the first token and the fourth.
    assert prefill > 0 and decode > 0
    # The first token splits first-scheduled-to-finish; arrival comes before it.
    assert inference == pytest.approx(prefill + decode, rel=1e-9, abs=1e-9)
    assert queue + inference == pytest.approx(e2e, rel=1e-9, abs=1e-9)
    assert prefill + decode <= e2e <= client_seconds


def test_cached_blocks_gauge_counts_a_new_prompts_full_blocks(live_server: LiveServer,
                                                              http: httpx.Client) -> None:
    before, _ = scrape(http)
    # Two blocks of token ids no other test sends; max_tokens=1 computes the prompt and
    # no more, so exactly its two full blocks are indexed (the pool has room: no eviction).
    complete(http, list(range(200, 200 + 2 * BLOCK_SIZE)), max_tokens=1)
    after, _ = scrape(http)
    assert after[("kvloom:num_evicted_blocks_total", ())] == before[("kvloom:num_evicted_blocks_total", ())]
    assert after[("kvloom:num_cached_blocks", ())] - before[("kvloom:num_cached_blocks", ())] == 2


def test_a_hit_ending_inside_a_block_is_copied_counted_and_reported(live_server: LiveServer,
                                                                    http: httpx.Client) -> None:
    # Two blocks of token ids no other test sends, then a prompt that shares a block and
    # a half of them: the half block is copied, and its tokens are cached tokens too.
    complete(http, list(range(240, 240 + 2 * BLOCK_SIZE)), max_tokens=1)
    before, _ = scrape(http)
    shared = BLOCK_SIZE + BLOCK_SIZE // 2
    usage = complete(http, list(range(240, 240 + shared)) + [7, 8, 9, 10, 11], max_tokens=1)["usage"]
    after, _ = scrape(http)
    assert usage["prompt_tokens_details"]["cached_tokens"] == shared
    copies = ("kvloom:prefix_cache_block_copies_total", ())
    assert after[copies] - before.get(copies, 0.0) == 1
