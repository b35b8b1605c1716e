"""Admission by LoRA adapter slots, on the fake runner, against a plain model of the slots:
a request on an adapter holds a slot while it runs, so no step ever runs more adapters than
there are slots; one that finds every slot busy waits (base-model requests go past it, later
adapter requests queue behind it), and preemption, abort and finishing give slots back."""

from __future__ import annotations

import random

from fake_runner import expected_output, fake_execute, make_request, make_scheduler, run_to_completion

from kvloom.engine.scheduler import Scheduler
from kvloom.engine.trace import SchedulerTrace, WaitReason
from kvloom.request import Request


class ModelSlots:
    """The slots as a set: at most ``size`` distinct adapters among the holders."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.holders: dict[str, str] = {}  # request id -> adapter
        self.unloaded: set[str] = set()

    def hold(self, request: Request) -> bool:
        if request.lora_key is None or request.request_id in self.holders:
            return True
        if request.lora_key in self.unloaded:
            raise ValueError(f"LoRA adapter {request.lora_key!r} was unloaded while the request waited")
        busy = set(self.holders.values())
        if request.lora_key not in busy and len(busy) >= self.size:
            return False
        self.holders[request.request_id] = request.lora_key
        return True

    def free(self, request: Request) -> None:
        self.holders.pop(request.request_id, None)


def on_adapter(request: Request, adapter: str | None) -> Request:
    request.lora_key = adapter
    return request


def with_slots(size: int, **config) -> tuple[Scheduler, ModelSlots]:
    scheduler = make_scheduler(**config)
    slots = scheduler.adapters = ModelSlots(size)
    scheduler.trace = SchedulerTrace(10_000)
    return scheduler, slots


def test_no_step_runs_more_adapters_than_slots_under_preemption_and_aborts() -> None:
    rng = random.Random(0)
    # 24 blocks of 4 tokens for up to 8 requests growing to ~40 tokens: preemption never stops.
    scheduler, slots = with_slots(2, num_blocks=24, block_size=4, max_num_seqs=8)
    adapters = [None, "a", "b", "c"]
    requests = [on_adapter(make_request(f"r{i}", rng.randrange(3, 20), rng.randrange(2, 20), first_token=i * 7),
                           rng.choice(adapters)) for i in range(40)]
    for request in requests:
        scheduler.add_request(request)
    aborted = {"r5", "r17"}

    def check(output) -> None:
        running = {request.request_id for request in scheduler.running}
        assert set(slots.holders) <= running  # only running requests hold slots
        assert len(set(slots.holders.values())) <= slots.size
        in_step = {item.request.lora_key for item in output.scheduled} - {None}
        assert len(in_step) <= slots.size  # the step ran at most as many adapters as slots
        assert {item.request.lora_key for item in output.scheduled
                if not item.request.is_finished} - {None} <= set(slots.holders.values())
        for request_id in aborted:
            if request_id in running:
                scheduler.abort_request(request_id)

    run_to_completion(scheduler, on_step=check)
    assert scheduler.num_preemptions > 0
    assert not slots.holders
    for request in requests:
        expected = expected_output(request)
        if request.request_id in aborted:  # cut short, or finished before the abort
            assert request.output_token_ids == expected[:len(request.output_token_ids)]
        else:
            assert request.output_token_ids == expected, request.request_id
    reasons = {reason for record in scheduler.trace.records for _, reason in record.waiting}
    assert WaitReason.LORA_SLOT_BUSY.value in reasons


def test_base_requests_go_past_a_waiting_one_and_adapter_requests_queue_behind_it() -> None:
    scheduler, slots = with_slots(1, num_blocks=64, block_size=4, max_num_seqs=8)
    first = on_adapter(make_request("a-first", 5, 6), "a")
    scheduler.add_request(first)
    scheduler.update(output := scheduler.schedule(), fake_execute(output))
    waiting_b = on_adapter(make_request("b", 5, 3), "b")
    base = make_request("base", 5, 3)
    later_a = on_adapter(make_request("a-later", 5, 3), "a")
    for request in (waiting_b, base, later_a):
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert {item.request.request_id for item in output.scheduled} == {"a-first", "base"}
    assert dict(scheduler.trace.records[-1].waiting) == {"b": WaitReason.LORA_SLOT_BUSY.value,
                                                         "a-later": WaitReason.LORA_SLOT_BUSY.value}
    scheduler.update(output, fake_execute(output))
    log = run_to_completion(scheduler)
    started = {}
    for step, out in enumerate(log):
        for item in out.scheduled:
            started.setdefault(item.request.request_id, step)
    assert started["b"] < started["a-later"]  # b took the slot first: a-later did not keep "a" busy
    for request in (first, waiting_b, base, later_a):
        assert request.output_token_ids == expected_output(request)


def test_a_request_whose_adapter_is_unloaded_while_it_waits_ends_with_the_error() -> None:
    scheduler, slots = with_slots(1, num_blocks=64, block_size=4)
    running = on_adapter(make_request("x", 5, 4), "a")
    orphan = on_adapter(make_request("y", 5, 4), "b")
    scheduler.add_request(running)
    scheduler.add_request(orphan)
    scheduler.update(output := scheduler.schedule(), fake_execute(output))
    slots.unloaded.add("b")
    run_to_completion(scheduler)
    assert orphan.error is not None and orphan.error.message == "LoRA adapter 'b' was unloaded while the request waited"
    assert orphan.error.caused_by_request and scheduler.take_ended() == [orphan]
    assert running.output_token_ids == expected_output(running)
