"""Admission by free state slots (a state-space model's), on the fake runner."""

from __future__ import annotations

import pytest
from fake_runner import expected_output, fake_execute, make_request, make_scheduler, run_to_completion

from kvloom.cache.block_pool import BlockPoolError
from kvloom.cache.state_pool import StatePool
from kvloom.engine.scheduler import Scheduler
from kvloom.engine.trace import SchedulerTrace, WaitReason


def with_slots(num_slots: int, **config) -> Scheduler:
    scheduler = make_scheduler(**config)
    scheduler.state = StatePool(num_slots)
    scheduler.trace = SchedulerTrace(1000)
    return scheduler


def test_requests_wait_for_a_state_slot_and_take_a_freed_one() -> None:
    scheduler = with_slots(2, num_blocks=256, block_size=4, max_num_seqs=8)
    requests = [make_request(f"r{i}", 6 + i, 4 + i, first_token=i * 11) for i in range(5)]
    for request in requests:
        scheduler.add_request(request)
    slots_seen: list[set[int]] = []
    log = run_to_completion(scheduler, on_step=lambda out: slots_seen.append(
        {item.request.state_slot for item in out.scheduled}))
    assert all(len(out.scheduled) <= 2 for out in log)  # never more running than slots
    assert set().union(*slots_seen) <= {0, 1, None}  # None: finished in that step
    for request in requests:
        assert request.output_token_ids == expected_output(request)
        assert request.state_slot is None
    assert scheduler.state.num_free_slots == 2
    reasons = {reason for record in scheduler.trace.records for _, reason in record.waiting}
    assert WaitReason.NO_FREE_STATE_SLOT.value in reasons
    # Each later request starts in the step after one before it finished.
    finished = {r.timeline.finished_step for r in requests}
    for request in requests[2:]:
        assert request.timeline.first_scheduled_step - 1 in finished


def test_a_waiting_request_blocks_behind_the_slots_not_the_budget() -> None:
    scheduler = with_slots(1, num_blocks=64, block_size=4, max_num_seqs=4)
    first, second = make_request("a", 5, 3), make_request("b", 5, 3)
    scheduler.add_request(first)
    scheduler.add_request(second)
    output = scheduler.schedule()
    assert [item.request for item in output.scheduled] == [first]
    assert scheduler.trace.records[-1].waiting == [("b", WaitReason.NO_FREE_STATE_SLOT.value)]
    scheduler.update(output, fake_execute(output))
    scheduler.check_integrity()


def test_preemption_and_abort_return_the_slot() -> None:
    # 10 blocks of 4 tokens: two requests growing to 40 tokens cannot both stay.
    scheduler = with_slots(2, num_blocks=10, block_size=4, max_num_seqs=4)
    requests = [make_request(f"r{i}", 10, 20, first_token=i * 5) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    log = run_to_completion(scheduler)
    assert scheduler.num_preemptions > 0 and any(out.preempted for out in log)
    for request in requests:
        assert request.output_token_ids == expected_output(request)
    assert scheduler.state.num_free_slots == 2

    scheduler = with_slots(1, num_blocks=64, block_size=4)
    scheduler.add_request(make_request("x", 5, 10))
    scheduler.add_request(make_request("y", 5, 2))
    output = scheduler.schedule()
    scheduler.update(output, fake_execute(output))
    scheduler.abort_request("x")
    scheduler.check_integrity()
    assert scheduler.state.num_free_slots == 1
    run_to_completion(scheduler)
    assert scheduler.state.num_free_slots == 1


def test_static_batching_admits_only_as_many_as_slots() -> None:
    # Static batching reserves max_model_len (16 tokens, 4 blocks) per request: blocks for all 3.
    scheduler = with_slots(2, num_blocks=256, block_size=4, scheduling="static", max_num_seqs=8, max_model_len=16)
    requests = [make_request(f"r{i}", 4, 3, first_token=i) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert len(output.scheduled) == 2
    run_to_completion(scheduler)
    assert all(request.output_token_ids == expected_output(request) for request in requests)


def test_the_schedulers_integrity_check_covers_the_slots() -> None:
    scheduler = with_slots(2, num_blocks=64, block_size=4)
    first, second = make_request("a", 5, 3), make_request("b", 5, 3)
    scheduler.add_request(first)
    scheduler.add_request(second)
    output = scheduler.schedule()
    scheduler.update(output, fake_execute(output))
    scheduler.check_integrity()
    second.state_slot = first.state_slot  # two requests on one slot
    with pytest.raises(BlockPoolError, match="state slot"):
        scheduler.check_integrity()
