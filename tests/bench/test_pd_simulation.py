"""`bench pd-sim`: the step-time model and the simulation, on hand-computed timelines."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvloom.bench.pd_simulation import (
    LinearFit,
    PiecewiseLinear,
    Scheduling,
    SimRequest,
    Slo,
    StepProfile,
    Workload,
    fit_linear,
    format_table,
    load_profile,
    points_from_steps,
    run_sweep,
    simulate_colocated,
    simulate_disaggregated,
    summarise,
    transfer_from_interference,
)
from kvloom.cli import main

# prefill(T) = 10 + T ms; decode(1) = 5, decode(2) = 6, decode(4) = 8 (and on, 1 ms a sequence)
PROFILE = StepProfile(LinearFit(10.0, 1.0), PiecewiseLinear.of([(1, 5.0), (4, 8.0)]))
# The hand-computed cases sample the first token where DistServe does, at the prefill's end.
SCHEDULING = Scheduling(token_budget=64, max_batch=8, first_token_on="prefill")


def _gaps(request: SimRequest) -> list[float]:
    return [b - a for a, b in zip(request.token_times, request.token_times[1:], strict=False)]


def test_fit_linear() -> None:
    assert fit_linear([(100, 110), (200, 210), (300, 310)]) == LinearFit(10.0, 1.0)
    fit = fit_linear([(0, 1), (1, 2), (2, 2), (3, 4)])  # least squares: sxy 4.5 / sxx 5, 2.25 - 0.9 * 1.5
    assert fit.per_token_ms == pytest.approx(0.9) and fit.intercept_ms == pytest.approx(0.9)
    assert fit_linear([(512, 255), (512, 257)]) == LinearFit(0.0, 0.5)  # one x: through the origin
    with pytest.raises(ValueError):
        fit_linear([])


def test_piecewise_linear_interpolation() -> None:
    curve = PiecewiseLinear.of([(4, 8.0), (1, 5.0), (16, 20.0), (16, 22.0)])  # repeated x averaged
    assert curve.points == ((1.0, 5.0), (4.0, 8.0), (16.0, 21.0))
    assert curve(0.5) == 5.0  # flat below the smallest batch
    assert curve(2) == 6.0 and curve(4) == 8.0 and curve(10) == 14.5
    assert curve(26) == pytest.approx(21.0 + 10 * 13 / 12)  # along the last segment above the largest
    assert PiecewiseLinear.of([(8, 3.0)])(100) == 3.0


def test_step_times_and_transfer() -> None:
    assert PROFILE.step_ms(100, 0) == 110.0  # a prefill step: a + b * T
    assert PROFILE.step_ms(0, 2) == 6.0  # a decode step
    assert PROFILE.step_ms(63, 1) == 5.0 + 63.0  # colocated: decode(B) + b * C
    moving = StepProfile(PROFILE.prefill, PROFILE.decode, kv_bytes_per_token=1000.0,
                         transfer_bytes_per_s=1e6, transfer_latency_ms=2.0)
    assert moving.transfer_ms(100) == pytest.approx(102.0)
    assert PROFILE.transfer_ms(10**6) == 0.0
    with pytest.raises(ValueError, match="transfer_bytes_per_s"):
        StepProfile(PROFILE.prefill, PROFILE.decode, transfer_bytes_per_s=0.0)


def test_profile_from_steps_json_and_measured_mixed_steps() -> None:
    steps = {"steps": [{"shape": "prefill 2 x 100", "milliseconds": [1.0], "median_ms": 210.0},
                       {"shape": "prefill 1 x 100", "milliseconds": [110.0, 110.0]},
                       {"shape": "decode b1 x 300", "median_ms": 5.0, "milliseconds": []},
                       {"shape": "decode b4 x 300", "median_ms": 8.0, "milliseconds": []}]}
    assert points_from_steps(steps) == {"prefill_ms": [[200, 210.0], [100, 110.0]],
                                        "decode_ms": [[1, 5.0], [4, 8.0]]}
    profile = load_profile(None, steps, kv_bytes_per_token=64.0, transfer_latency_ms=None)
    assert profile.prefill == LinearFit(10.0, 1.0) and profile.decode(2) == 6.0
    assert profile.kv_bytes_per_token == 64.0 and profile.transfer_latency_ms == 0.0
    # Measured colocated steps: the chunk's cost on top of decode(B) is a line of its own.
    mixed = load_profile({"mixed_ms": [[100, 1, 5 + 2 + 50], [200, 4, 8 + 2 + 100]]}, steps)
    assert mixed.chunk == LinearFit(2.0, 0.5) and mixed.step_ms(100, 1) == 57.0
    assert load_profile({"decode_ms": [[1, 7.0]]}, steps).decode(4) == 7.0  # the profile wins
    with pytest.raises(ValueError, match="unknown profile keys"):
        load_profile({"prefill": []}, steps)
    with pytest.raises(ValueError, match="decode_ms"):
        load_profile({"prefill_ms": [[1, 1]]})


def test_transfer_measured_by_bench_interference() -> None:
    measured = {"parameters": {"num_prompts": 2, "prompt_len": 100}, "transfer_counters": {
        "kvloom:kv_transfer_import_bytes_total": {"delta": 200_000.0, "per_prompt": 100_000.0},
        "kvloom:kv_transfer_import_seconds_total": {"delta": 0.2, "per_prompt": 0.1},
        "kvloom:kv_transfer_staged_bytes_total": {"delta": 200_000.0, "per_prompt": 100_000.0}}}
    assert transfer_from_interference(measured) == {"kv_bytes_per_token": 1000.0, "transfer_bytes_per_s": 1e6}
    with pytest.raises(ValueError, match="disaggregated"):
        transfer_from_interference({"parameters": {}, "transfer_counters": {}})


def test_one_request_without_transfer_cost() -> None:
    [request] = simulate_disaggregated([SimRequest(0.0, 100, 3)], PROFILE, SCHEDULING, 1, 1)
    assert request.token_times == [110.0, 115.0, 120.0]  # TTFT = prefill(100), ITL = decode(1)


def test_first_token_on_the_decode_instance() -> None:
    # kvloom's router: the decode instance samples the first token once the KV is in.
    moving = StepProfile(PROFILE.prefill, PROFILE.decode, kv_bytes_per_token=1000.0,
                         transfer_bytes_per_s=1e6, transfer_latency_ms=2.0)
    kvloom = Scheduling(token_budget=64, max_batch=8)
    [request] = simulate_disaggregated([SimRequest(0.0, 100, 2)], moving, kvloom, 1, 1)
    assert request.token_times == pytest.approx([110.0 + 102.0 + 5.0, 110.0 + 102.0 + 10.0])
    with pytest.raises(ValueError, match="first_token_on"):
        Scheduling(first_token_on="router")


def test_transfer_delays_the_second_token() -> None:
    moving = StepProfile(PROFILE.prefill, PROFILE.decode, kv_bytes_per_token=1000.0,
                         transfer_bytes_per_s=1e6, transfer_latency_ms=2.0)
    [request] = simulate_disaggregated([SimRequest(0.0, 100, 3)], moving, SCHEDULING, 1, 1)
    assert request.token_times == pytest.approx([110.0, 110.0 + 102.0 + 5.0, 110.0 + 102.0 + 10.0])


def test_prefill_instance_is_fcfs_one_prompt_at_a_time() -> None:
    first, second = simulate_disaggregated([SimRequest(0.0, 100, 1), SimRequest(0.0, 100, 1)],
                                           PROFILE, SCHEDULING, 1, 1)
    assert first.token_times == [110.0] and second.token_times == [220.0]  # the second waits: 2x
    batched = Scheduling(token_budget=64, max_batch=8, prefill_token_budget=200, first_token_on="prefill")
    together = simulate_disaggregated([SimRequest(0.0, 100, 1), SimRequest(0.0, 100, 1)],
                                      PROFILE, batched, 1, 1)
    assert [r.token_times for r in together] == [[210.0], [210.0]]  # one step of prefill(200)
    spread = simulate_disaggregated([SimRequest(0.0, 100, 1), SimRequest(0.0, 100, 1)], PROFILE, SCHEDULING, 2, 1)
    assert [r.token_times for r in spread] == [[110.0], [110.0]]  # least loaded: one each


def test_decode_itl_is_the_step_time_of_the_batch() -> None:
    together = simulate_disaggregated([SimRequest(0.0, 100, 3), SimRequest(0.0, 100, 3)], PROFILE, SCHEDULING, 2, 1)
    assert [r.token_times for r in together] == [[110.0, 116.0, 122.0]] * 2  # arrived together: decode(2)
    a, b = simulate_disaggregated([SimRequest(0.0, 100, 4), SimRequest(2.0, 100, 4)], PROFILE, SCHEDULING, 2, 1)
    # a decodes alone from 110; b's KV arrives at 112, mid-step, and joins at the step's end (115).
    assert a.token_times == [110.0, 115.0, 121.0, 127.0] and b.token_times == [112.0, 121.0, 127.0, 132.0]
    assert _gaps(a) == [5.0, 6.0, 6.0] and _gaps(b) == [9.0, 6.0, 5.0]  # decode(1), decode(2), alone again


def test_decode_batch_limit_makes_requests_wait() -> None:
    one = Scheduling(token_budget=64, max_batch=1, first_token_on="prefill")
    a, b = simulate_disaggregated([SimRequest(0.0, 100, 3), SimRequest(0.0, 100, 2)], PROFILE, one, 2, 1)
    assert a.token_times == [110.0, 115.0, 120.0] and b.token_times == [110.0, 125.0]  # b waits for a slot


def test_colocated_chunked_prefill_stretches_the_running_decode() -> None:
    a, b = simulate_colocated([SimRequest(0.0, 10, 6), SimRequest(22.0, 100, 3)], PROFILE, SCHEDULING, 1)
    # a: prefill(10) = 20, a decode (5); then b comes in chunks of 63 and 37 tokens, each step
    # also advancing a: decode(1) + 63 = 68 and decode(1) + 37 = 42; then both decode (6).
    assert a.token_times == [20.0, 25.0, 93.0, 135.0, 141.0, 147.0]
    assert _gaps(a) == [5.0, 68.0, 42.0, 6.0, 6.0]
    assert b.token_times == [135.0, 141.0, 147.0]  # TTFT 113


def test_colocated_routes_to_the_least_loaded_instance() -> None:
    a, b = simulate_colocated([SimRequest(0.0, 100, 2), SimRequest(0.0, 100, 2)], PROFILE, SCHEDULING, 2)
    # One each, in two chunks (the budget is 64): prefill(64) + prefill(36), then decode(1).
    assert a.token_times == b.token_times == [120.0, 125.0]


def test_slo_goodput_counting() -> None:
    meets = SimRequest(0.0, 1, 3, token_times=[50.0, 60.0, 70.0])
    slow_start = SimRequest(0.0, 1, 2, token_times=[150.0, 155.0])
    one_stall = SimRequest(10.0, 1, 4, token_times=[60.0, 62.0, 64.0, 80.0])  # mean gap 6.7, max 16
    single = SimRequest(0.0, 1, 1, token_times=[100.0])  # no gaps: ITL 0
    requests = [meets, slow_start, one_stall, single]
    summary = summarise(requests, Slo(ttft_ms=100.0, itl_ms=10.0, itl_stat="mean"))
    assert summary["slo_attainment"] == 3 / 4
    assert summarise(requests, Slo(100.0, 10.0, "max"))["slo_attainment"] == 2 / 4
    assert summary["ttft_p50_ms"] == 75.0 and summary["throughput_tok_s"] == 1e3 * 10 / 155.0
    with pytest.raises(ValueError, match="itl_stat"):
        Slo(100.0, 10.0, "median")


def _split_wins_result() -> dict[str, object]:
    # Long decodes (so prompts always arrive on a busy instance) and a 100-token chunk that
    # stalls a colocated decode for 105 ms, against a max-ITL SLO of 60 ms.
    workload = Workload(20, prompt_lens=(100,), output_lens=(400,), seed=3)
    return run_sweep(PROFILE, Scheduling(token_budget=64, max_batch=32), workload, [1.0, 2.0], [(1, 1)],
                     Slo(1000.0, 60.0, "max"))


def test_sweep_rows_and_verdict() -> None:
    result = _split_wins_result()
    rows = result["rows"]
    assert [(r["placement"], r["rate"]) for r in rows] == [("1P:1D", 1.0), ("1P:1D", 2.0),
                                                           ("colocated x2", 1.0), ("colocated x2", 2.0)]
    assert all(r["slo_attainment"] == 1.0 for r in rows[:2])
    assert all(r["slo_attainment"] < 0.9 for r in rows[2:])
    [line] = result["summary"]
    assert line.startswith("1P:1D vs 2 colocated") and "the split pays off" in line
    assert "split up to 2 req/s (1 per core, the highest swept)" in line and "colocated at no rate" in line
    table = format_table(result)
    assert "colocated x2" in table and line in table


def test_plot_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"prefill_ms": [[100, 110], [200, 210]], "decode_ms": [[1, 5], [4, 8]],
                                   "kv_bytes_per_token": 1000}))
    interference = tmp_path / "interference.json"
    interference.write_text(json.dumps({"parameters": {"num_prompts": 1, "prompt_len": 10}, "transfer_counters": {
        "kvloom:kv_transfer_import_bytes_total": {"delta": 500.0},
        "kvloom:kv_transfer_import_seconds_total": {"delta": 1e-3}}}))
    out = tmp_path / "result.json"
    code = main(["bench", "pd-sim", "--profile", str(profile), "--splits", "1:1,2:1", "--rates", "1,2",
                 "--num-requests", "10", "--prompt-len", "50,100", "--output-len", "20",
                 "--transfer-json", str(interference), "--kv-bytes-per-token", "64",
                 "--result-json", str(out), "--plot", str(tmp_path / "p.png")])
    assert code == 0
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 2 * 2 * 2 and len(result["summary"]) == 2
    # The measured rate comes from --transfer-json; the flag wins over its bytes per token.
    assert result["profile"]["transfer_bytes_per_s"] == pytest.approx(5e5)
    assert result["profile"]["kv_bytes_per_token"] == 64.0 and result["workload"]["prompt_lens"] == [50, 100]
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")
    assert "2P:1D vs 3 colocated" in capsys.readouterr().out
    assert math.isfinite(result["rows"][0]["throughput_tok_s"])
