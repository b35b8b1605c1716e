"""Continuous batching, budgets and block accounting, on a fake model runner."""

from __future__ import annotations

import pytest
from fake_runner import expected_output, make_request, make_scheduler, run_to_completion

from kvloom.engine.admission import RequestRejected


def test_continuous_batching_admits_in_the_step_after_a_finish() -> None:
    scheduler = make_scheduler(num_blocks=256, block_size=4, max_num_seqs=4)
    lengths = [(5, 3), (17, 40), (3, 8), (30, 2), (9, 25), (4, 1), (12, 12), (7, 30),
               (21, 5), (2, 17), (15, 9), (6, 6)]
    requests = [make_request(f"r{i}", p, m, first_token=i * 13) for i, (p, m) in enumerate(lengths)]
    for request in requests:
        scheduler.add_request(request)
    log = run_to_completion(scheduler, on_step=lambda out: None)
    assert all(len(out.scheduled) <= 4 for out in log)
    for request in requests:
        assert request.output_token_ids == expected_output(request)
        assert request.is_finished and request.block_ids == []
    finish_steps = sorted(r.timeline.finished_step for r in requests)
    starts = sorted(r.timeline.first_scheduled_step for r in requests)[4:]
    # Each of the 8 late requests starts in the step right after a slot was freed.
    for start in starts:
        assert start - 1 in finish_steps
    assert scheduler.kv.pool.num_free_blocks == 256


def test_token_budget_is_never_exceeded() -> None:
    scheduler = make_scheduler(num_blocks=512, block_size=8, max_num_batched_tokens=32)
    for i in range(6):
        scheduler.add_request(make_request(f"r{i}", 50 + i * 7, 5))
    log = run_to_completion(scheduler)
    assert max(out.num_batched_tokens for out in log) <= 32


def test_blocks_allocated_on_demand() -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    request = make_request("a", 5, 8)
    scheduler.add_request(request)
    held = []
    run_to_completion(scheduler, on_step=lambda out: held.append(
        (request.num_computed_tokens, len(request.block_ids))))
    # After each step the request holds exactly ceil(tokens in flight / block size) blocks.
    for computed, blocks in held[:-1]:
        assert blocks == -(-(computed + 1) // 4) or blocks == -(-computed // 4)
        assert blocks * 4 - computed < 4 + 1


def test_oversized_and_overlong_requests_rejected() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(RequestRejected, match="KV blocks"):
        scheduler.add_request(make_request("big", 10, 10))
    with pytest.raises(RequestRejected, match="context"):
        scheduler.add_request(make_request("long", 64, 1))
    scheduler.check_integrity()


def test_abort_frees_blocks() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=1)
    running, waiting = make_request("run", 10, 20), make_request("wait", 10, 20)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    output = scheduler.schedule()
    assert [s.request for s in output.scheduled] == [running]
    scheduler.abort_request("run")
    scheduler.abort_request("wait")
    scheduler.check_integrity()
    assert scheduler.kv.pool.num_free_blocks == 32
    assert not scheduler.has_unfinished


def test_static_batching_waits_for_the_longest_member() -> None:
    scheduler = make_scheduler(num_blocks=256, block_size=4, max_num_seqs=2, scheduling="static")
    short, long_, later = make_request("s", 4, 2), make_request("l", 4, 20), make_request("x", 4, 2)
    for request in (short, long_, later):
        scheduler.add_request(request)
    run_to_completion(scheduler)
    assert later.timeline.first_scheduled_step > long_.timeline.finished_step
    assert later.output_token_ids == expected_output(later)
