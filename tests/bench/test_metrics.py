"""Metric arithmetic against hand-computed examples (vLLM's definitions)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvloom.bench.metrics import (
    BenchMetrics,
    Distribution,
    RequestRecord,
    compute_metrics,
    counter_deltas,
    format_report,
    meets_slo,
    parse_prometheus,
    parse_slo,
    percentile,
)


def _records() -> list[RequestRecord]:
    return [
        # TPOT (0.6 - 0.1) / 4 = 0.125 s
        RequestRecord(0, prompt_len=10, output_len=5, ttft=0.1, itl=[0.1, 0.2, 0.1, 0.1], e2e=0.6,
                      server_prompt_tokens=12, turn=0),
        # one token: no TPOT (0 for goodput)
        RequestRecord(1, prompt_len=20, output_len=1, ttft=0.3, itl=[], e2e=0.3,
                      server_prompt_tokens=22, turn=1),
        # TPOT (1.0 - 0.2) / 2 = 0.4 s
        RequestRecord(2, prompt_len=30, output_len=3, ttft=0.2, itl=[0.4, 0.4], e2e=1.0,
                      server_prompt_tokens=32, turn=1),
        RequestRecord(3, prompt_len=40, error="HTTP 500: boom", e2e=0.05, turn=0),
    ]


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)  # rank 2.7
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([7], 99) == 7
    rng = np.random.default_rng(0)
    values = rng.exponential(size=101).tolist()
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    with pytest.raises(ValueError):
        percentile([], 50)


def test_tpot_is_decode_time_per_token_after_the_first() -> None:
    assert RequestRecord(0, 1, output_len=10, ttft=0.1, e2e=1.0).tpot == pytest.approx(0.1)
    assert RequestRecord(0, 1, output_len=1, ttft=0.1, e2e=0.1).tpot is None
    assert RequestRecord(0, 1, output_len=0, error="x").tpot is None


def test_aggregate_metrics_by_hand() -> None:
    metrics = compute_metrics(_records(), duration_s=2.0)
    assert (metrics.completed, metrics.failed) == (3, 1)
    assert (metrics.total_input_tokens, metrics.total_output_tokens) == (60, 9)
    assert metrics.server_input_tokens == 66
    assert metrics.request_throughput == pytest.approx(1.5)
    assert metrics.output_throughput == pytest.approx(4.5)
    assert metrics.total_token_throughput == pytest.approx(34.5)
    assert metrics.goodput is None
    ttft = metrics.ttft_ms  # [100, 300, 200]
    assert (ttft.count, ttft.mean, ttft.median) == (3, pytest.approx(200), pytest.approx(200))
    assert ttft.std == pytest.approx(math.sqrt(20000 / 3))  # population std
    assert ttft.p90 == pytest.approx(280) and ttft.p99 == pytest.approx(298)
    assert metrics.tpot_ms.count == 2 and metrics.tpot_ms.mean == pytest.approx(262.5)
    # ITL pools the gaps of every request: [100, 200, 100, 100, 400, 400]
    assert metrics.itl_ms.count == 6
    assert metrics.itl_ms.mean == pytest.approx(1300 / 6)
    assert metrics.itl_ms.median == pytest.approx(150)
    assert metrics.e2el_ms.mean == pytest.approx(1900 / 3)
    assert metrics.errors == {"HTTP 500: boom": 1}
    assert set(metrics.ttft_ms_by_turn) == {0, 1}
    assert metrics.ttft_ms_by_turn[1].mean == pytest.approx(250)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    records = _records()
    # r0 meets both; r1 misses TTFT; r2 misses TPOT
    assert compute_metrics(records, 2.0, {"ttft": 250, "tpot": 200}).goodput == pytest.approx(0.5)
    assert compute_metrics(records, 2.0, {"ttft": 350}).goodput == pytest.approx(1.5)
    # a one-token request's TPOT counts as 0 (vLLM's convention): r0 and r1 pass
    assert compute_metrics(records, 2.0, {"tpot": 130}).goodput == pytest.approx(1.0)
    assert compute_metrics(records, 2.0, {"e2el": 700}).goodput == pytest.approx(1.0)
    assert not meets_slo(records[3], {"ttft": 1e9})  # failed requests never count


def test_parse_slo() -> None:
    assert parse_slo("ttft:500, tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_slo("e2e:1000") == {"e2el": 1000.0}
    assert parse_slo(None) == {}
    for bad in ("ttft", "itl:5", "ttft:abc", "ttft:0"):
        with pytest.raises(ValueError, match="--slo"):
            parse_slo(bad)


def test_empty_distributions_and_zero_duration() -> None:
    metrics = compute_metrics([RequestRecord(0, 5, error="refused")], 1.0)
    assert metrics.completed == 0 and metrics.ttft_ms == Distribution(0, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert metrics.server_input_tokens is None
    with pytest.raises(ValueError):
        compute_metrics([], 0.0)


def test_server_input_tokens_needs_every_usage() -> None:
    records = _records()[:3]
    records[1].server_prompt_tokens = None
    assert compute_metrics(records, 1.0).server_input_tokens is None


def test_metrics_round_trip_through_json() -> None:
    metrics = compute_metrics(_records(), 2.0, {"ttft": 250})
    restored = BenchMetrics.from_json(json.loads(json.dumps(metrics.to_json())))
    assert restored == metrics
    text = format_report(restored, {"kvloom:prefix_cache_hit_rate": 0.25})
    assert "Mean TTFT (ms):" in text and "200.00" in text and "goodput" in text
    assert "Turn 1" in text and "0.250" in text and "HTTP 500: boom" in text


def test_parse_prometheus_sums_label_sets_and_skips_junk() -> None:
    text = """# HELP vllm:prefix_cache_hits hits
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{model_name="m",engine="0"} 10.0
vllm:prefix_cache_hits_total{model_name="m",engine="1"} 5
vllm:weird{path="a } b",q="x\\"y"} 3 1700000000000
kvloom:num_preemptions_total 2.0
garbage line here
no_value
nan_metric NaN
"""
    parsed = parse_prometheus(text)
    assert parsed["vllm:prefix_cache_hits_total"] == 15.0
    assert parsed["vllm:weird"] == 3.0
    assert parsed["kvloom:num_preemptions_total"] == 2.0
    assert "garbage" not in parsed and "no_value" not in parsed
    assert math.isnan(parsed["nan_metric"])


def test_counter_deltas_pick_engine_counters() -> None:
    before = {"kvloom:prefix_cache_hits_total": 10.0, "kvloom:prefix_cache_queries_total": 100.0,
              "kvloom:num_preemptions_total": 1.0, "kvloom:prefix_cache_hits_created": 5.0,
              "kvloom:num_requests_running": 2.0, "process_cpu_seconds_total": 1.0}
    after = {"kvloom:prefix_cache_hits_total": 40.0, "kvloom:prefix_cache_queries_total": 200.0,
             "kvloom:num_preemptions_total": 4.0, "kvloom:prefix_cache_hits_created": 9.0,
             "kvloom:num_requests_running": 0.0, "process_cpu_seconds_total": 9.0,
             "sglang:num_retracted_reqs_total": 3.0}
    deltas = counter_deltas(before, after)
    assert deltas == {"kvloom:prefix_cache_hits_total": 30.0, "kvloom:prefix_cache_queries_total": 100.0,
                      "kvloom:num_preemptions_total": 3.0, "sglang:num_retracted_reqs_total": 3.0,
                      "kvloom:prefix_cache_hit_rate": pytest.approx(0.3)}
    assert counter_deltas(None, after) == {} and counter_deltas(before, None) == {}


def test_counter_deltas_derive_speculative_rates_for_kvloom_and_vllm() -> None:
    before = {"vllm:spec_decode_num_drafts_total": 10.0, "vllm:spec_decode_num_draft_tokens_total": 40.0,
              "vllm:spec_decode_num_accepted_tokens_total": 20.0,
              "vllm:spec_decode_num_accepted_tokens_per_pos_total": 20.0}
    after = {"vllm:spec_decode_num_drafts_total": 30.0, "vllm:spec_decode_num_draft_tokens_total": 120.0,
             "vllm:spec_decode_num_accepted_tokens_total": 50.0,
             "vllm:spec_decode_num_accepted_tokens_per_pos_total": 50.0}
    deltas = counter_deltas(before, after)
    # 30 of 80 draft tokens accepted over 20 verifications: 1 + 30 / 20 tokens each.
    assert deltas["vllm:spec_decode_acceptance_rate"] == pytest.approx(30 / 80)
    assert deltas["vllm:spec_decode_mean_accepted_length"] == pytest.approx(2.5)
    assert "kvloom:spec_decode_acceptance_rate" not in deltas
    # A restarted server (counter went down) or a NaN sample yields no delta, not garbage.
    odd = counter_deltas({"vllm:num_preemptions_total": 9.0}, {"vllm:num_preemptions_total": 2.0,
                                                               "vllm:prefix_cache_hits_total": math.nan})
    assert odd == {}
