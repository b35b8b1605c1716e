"""Chunked prefill, preemption, policies and the decision record (fake runner)."""

from __future__ import annotations

import random

import pytest
from fake_runner import expected_output, make_request, make_scheduler, run_to_completion

from kvloom.engine.admission import RequestRejected
from kvloom.engine.trace import WaitReason
from kvloom.request import Request, RequestStatus
from kvloom.sampling_params import SamplingParams


def reasons_seen(scheduler) -> dict[str, set[str]]:
    seen: dict[str, set[str]] = {}
    for record in scheduler.trace.records:
        for request_id, reason in record.waiting:
            seen.setdefault(request_id, set()).add(reason)
    return seen


def test_preemption_under_memory_pressure_keeps_outputs() -> None:
    # 24 blocks of 4 tokens hold about three requests of 30 tokens.
    scheduler = make_scheduler(num_blocks=24, block_size=4, trace=True)
    requests = [make_request(f"r{i}", 10 + i % 5, 20, first_token=i * 31) for i in range(20)]
    for request in requests:
        scheduler.add_request(request)
    run_to_completion(scheduler)
    assert scheduler.num_preemptions > 0
    preempted_ids = {rid for record in scheduler.trace.records for rid, _ in record.preempted}
    assert preempted_ids
    for record in scheduler.trace.records:
        for _, reason in record.preempted:
            assert reason.startswith("no free blocks")
    for request in requests:
        assert request.output_token_ids == expected_output(request)
    assert scheduler.kv.pool.num_free_blocks == 24


def test_a_sliding_window_runs_more_at_once_and_keeps_outputs() -> None:
    """20 requests of 10-14 + 60 tokens in 24 blocks of 4, with the prefix cache, every
    integrity check after every step: under a window of 8 keys each holds its prompt and
    about three blocks, not its 18-19, so more run at once: the run takes under half the
    steps and fewer preemptions than without the window (186 and 11 against 672 and 51),
    and every output is the fake model's."""
    def run(window: int):
        scheduler = make_scheduler(num_blocks=24, block_size=4, prefix_cache=True, window=window)
        requests = [make_request(f"r{i}", 10 + i % 5, 60, first_token=i * 31) for i in range(20)]
        for request in requests:
            scheduler.add_request(request)
        batch_sizes = []
        run_to_completion(scheduler, on_step=lambda output: batch_sizes.append(len(output.scheduled)))
        for request in requests:
            assert request.output_token_ids == expected_output(request)
        assert scheduler.kv.pool.num_free_blocks + scheduler.kv.prefix_cache.num_cached_blocks == 24
        return scheduler, batch_sizes

    windowed, windowed_batches = run(8)
    plain, plain_batches = run(0)
    assert windowed.kv.num_window_freed_blocks > 0 and plain.kv.num_window_freed_blocks == 0
    assert 2 * len(windowed_batches) < len(plain_batches) and windowed.num_preemptions < plain.num_preemptions


@pytest.mark.parametrize("seed", range(20))
def test_windows_with_shared_prefixes_preemption_and_aborts_lose_nothing(seed: int) -> None:
    """Random requests, many sharing long prefixes (hits, partial blocks, tails, paths
    given back while others hold them), some aborted mid-run, in a pool that preempts,
    under windows of 4-12 keys: every integrity check after every step passes, every
    finished request's output is the fake model's, and the pool ends holding only the cache."""
    rng = random.Random(seed)
    window, block_size = rng.choice([4, 8, 12]), rng.choice([2, 4])
    scheduler = make_scheduler(num_blocks=28, block_size=block_size, prefix_cache=True, window=window,
                               max_num_batched_tokens=rng.choice([8, 16, 64]))
    stems = [[rng.randrange(1, 900) for _ in range(rng.randrange(2, 30))] for _ in range(3)]
    requests = []
    for index in range(24):
        prompt = rng.choice(stems) + [rng.randrange(1, 900) for _ in range(rng.randrange(0, 6))]
        request = Request(f"r{index}", prompt, SamplingParams(max_tokens=rng.randrange(1, 50), ignore_eos=True))
        try:
            scheduler.add_request(request)
        except RequestRejected:  # more than the pool holds at once, even under the window
            continue
        requests.append(request)
    aborted = set(rng.sample([r.request_id for r in requests], 4))
    steps = 0

    def abort_some(output) -> None:
        nonlocal steps
        steps += 1
        if steps % 7 == 0 and aborted:
            scheduler.abort_request(aborted.pop())
            scheduler.check_integrity()

    run_to_completion(scheduler, on_step=abort_some)
    for request in requests:
        if request.status is not RequestStatus.FINISHED_ABORTED:
            assert request.output_token_ids == expected_output(request)
    kv = scheduler.kv
    assert kv.pool.num_free_blocks + kv.prefix_cache.num_cached_blocks == 28
    assert kv.prefix_cache.num_evictable_blocks == kv.prefix_cache.num_cached_blocks  # nothing left pinned


def test_chunked_prefill_keeps_decodes_flowing() -> None:
    scheduler = make_scheduler(num_blocks=1024, block_size=16, max_num_batched_tokens=256, trace=True)
    decoders = [make_request(f"d{i}", 8, 200, first_token=i) for i in range(4)]
    for request in decoders:
        scheduler.add_request(request)
    for _ in range(3):  # decoders are now past their prefill
        output = scheduler.schedule()
        from fake_runner import fake_execute
        scheduler.update(output, fake_execute(output))
    long_prompt = make_request("long", 2000, 4)
    scheduler.add_request(long_prompt)
    prefill_steps = 0
    while long_prompt.num_computed_tokens < long_prompt.num_prompt_tokens:
        output = scheduler.schedule()
        ids = {item.request.request_id: item.num_new_tokens for item in output.scheduled}
        assert output.num_batched_tokens <= 256
        assert all(ids.get(d.request_id) == 1 for d in decoders), "a decode missed a step"
        from fake_runner import fake_execute
        scheduler.update(output, fake_execute(output))
        scheduler.check_integrity()
        prefill_steps += 1
    assert prefill_steps >= 2000 // 256
    assert len(long_prompt.timeline.prefill_chunks) == prefill_steps


def test_long_prefill_threshold_caps_one_requests_chunk() -> None:
    scheduler = make_scheduler(num_blocks=512, block_size=8, max_num_batched_tokens=512,
                               long_prefill_threshold=64)
    a, b = make_request("a", 300, 2), make_request("b", 300, 2, first_token=7)
    scheduler.add_request(a)
    scheduler.add_request(b)
    output = scheduler.schedule()
    # Two prompts prefill in the same step, each capped at 64 tokens.
    assert [(i.request.request_id, i.num_new_tokens) for i in output.scheduled] == [("a", 64), ("b", 64)]


def test_priority_runs_urgent_request_first_and_starvation_bound_holds() -> None:
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=2, policy="priority", trace=True)
    low = [make_request(f"low{i}", 6, 10, priority=5, first_token=i) for i in range(6)]
    urgent = make_request("urgent", 6, 10, priority=0, first_token=99)
    for request in low + [urgent]:
        scheduler.add_request(request)
    run_to_completion(scheduler)
    finish = {r.request_id: r.timeline.finished_step for r in low + [urgent]}
    assert finish["urgent"] <= min(finish[f"low{i}"] for i in range(6))

    # A steady stream of priority-0 work would starve a priority-9 request forever;
    # max_wait_steps bounds its wait.
    scheduler = make_scheduler(num_blocks=256, block_size=4, max_num_seqs=1, policy="priority",
                               max_wait_steps=30)
    starving = make_request("starving", 4, 2, priority=9)
    scheduler.add_request(starving)
    for i in range(40):
        scheduler.add_request(make_request(f"hi{i}", 4, 5, priority=0, first_token=i))
    run_to_completion(scheduler)
    wait = starving.timeline.first_scheduled_step - starving.timeline.arrival_step
    assert wait <= 30 + 6  # the bound plus at most one running request's remaining steps
    assert scheduler.num_starvation_promotions > 0


def test_decision_record_names_each_reason() -> None:
    # max_num_seqs
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=1, trace=True)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 4, 3, first_token=i))
    scheduler.schedule()
    assert dict(scheduler.trace.records[-1].waiting) == {"r1": "max_num_seqs", "r2": "max_num_seqs"}

    # token budget
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=8, trace=True)
    for i in range(2):
        scheduler.add_request(make_request(f"r{i}", 8, 3, first_token=i))
    scheduler.schedule()
    assert dict(scheduler.trace.records[-1].waiting) == {"r1": WaitReason.TOKEN_BUDGET.value}

    # no free blocks for the head; the one behind it waits on policy order
    scheduler = make_scheduler(num_blocks=6, block_size=4, trace=True)
    scheduler.add_request(make_request("big", 16, 4))
    scheduler.add_request(make_request("next", 12, 4, first_token=5))
    scheduler.add_request(make_request("after", 2, 2, first_token=9))
    scheduler.schedule()
    assert dict(scheduler.trace.records[-1].waiting) == {
        "next": WaitReason.NO_FREE_BLOCKS.value, "after": WaitReason.POLICY_ORDER.value}

    # watermark: above the high watermark only requests whose full growth fits get in
    scheduler = make_scheduler(num_blocks=20, block_size=4, policy="watermark", low_watermark=0.3,
                               high_watermark=0.5, trace=True)
    scheduler.add_request(make_request("first", 40, 2))
    scheduler.schedule()
    scheduler.add_request(make_request("grower", 4, 60, first_token=3))
    scheduler.schedule()
    assert dict(scheduler.trace.records[-1].waiting) == {"grower": WaitReason.WATERMARK.value}
    # ... under a sliding window of 8 keys its growth is what it holds at once: its prompt's
    # block and a window's (3 indexed, cdiv(8 + 1, 4) + 2 moving: 8 of the 9 available), not 16
    scheduler = make_scheduler(num_blocks=20, block_size=4, policy="watermark", low_watermark=0.3,
                               high_watermark=0.5, trace=True, window=8)
    scheduler.add_request(make_request("first", 40, 2))
    scheduler.schedule()
    grower = make_request("grower", 4, 60, first_token=3)
    scheduler.add_request(grower)
    scheduler.schedule()
    assert scheduler.kv.blocks_to_finish(grower) == 8 and grower in scheduler.running

    # preemption pauses admission for the step
    scheduler = make_scheduler(num_blocks=4, block_size=4, trace=True)
    scheduler.add_request(make_request("a", 4, 8))
    scheduler.add_request(make_request("b", 4, 8, first_token=3))
    log = run_to_completion(scheduler)
    pool_full = [r for r in scheduler.trace.records if r.preempted]
    assert pool_full and all(r.preempted[0][1].startswith("no free blocks") for r in pool_full)
    assert any(WaitReason.POOL_FULL.value in reasons for reasons in reasons_seen(scheduler).values())
    assert len(log) == len(scheduler.trace.records)


def test_abort_running_waiting_and_preempted_frees_everything() -> None:
    scheduler = make_scheduler(num_blocks=6, block_size=4, trace=True)
    a, b, c = make_request("a", 8, 12), make_request("b", 8, 12, first_token=4), make_request("c", 4, 4)
    for request in (a, b, c):
        scheduler.add_request(request)
    from fake_runner import fake_execute
    for _ in range(12):
        output = scheduler.schedule()
        scheduler.update(output, fake_execute(output))
        if b.status is RequestStatus.PREEMPTED or a.status is RequestStatus.PREEMPTED:
            break
    preempted = a if a.status is RequestStatus.PREEMPTED else b
    assert preempted.status is RequestStatus.PREEMPTED
    for request_id in ("a", "b", "c"):
        scheduler.abort_request(request_id)
    scheduler.check_integrity()
    assert scheduler.kv.pool.num_free_blocks == 6
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in (a, b, c) if r.timeline.finished_step)


def test_unchunked_prefill_takes_whole_prompts() -> None:
    scheduler = make_scheduler(num_blocks=256, block_size=4, max_num_batched_tokens=32,
                               enable_chunked_prefill=False)
    big, small = make_request("big", 50, 3), make_request("small", 20, 3, first_token=8)
    scheduler.add_request(big)
    scheduler.add_request(small)
    output = scheduler.schedule()
    assert [(i.request.request_id, i.num_new_tokens) for i in output.scheduled] == [("big", 50)]
    run_to_completion(scheduler)
    assert big.output_token_ids == expected_output(big)
    assert small.output_token_ids == expected_output(small)


def test_lpm_says_when_it_falls_back_to_fcfs() -> None:
    from kvloom.engine.policy import LongestPrefixMatchPolicy

    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=1, policy="lpm", prefix_cache=True)
    for i in range(LongestPrefixMatchPolicy.MAX_SCORED + 2):
        scheduler.add_request(make_request(f"r{i}", 4, 1, first_token=i))
    scheduler.schedule()
    assert scheduler.policy.num_fcfs_fallbacks == 1
