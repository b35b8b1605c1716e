"""Overlap scheduling (engine/overlap.py) on the CPU, forced on: a step is scheduled and
launched before the previous one's tokens are committed, its pending inputs read from
the previous step's samples on the device. Greedy tokens equal transformers'; seeded
random tokens, stops, preemption, prefix hits, aborts and per-request failures give
what the synchronous engine gives, and no block leaks."""

from __future__ import annotations

import random

import pytest
import torch
from helpers_engine import fail_output_of, run_arrivals, token_ids
from helpers_models import hf_greedy_tokens

from kvloom import SamplingParams
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.request import RequestError
from kvloom.structured.constraint import StructuredOutput

RNG = random.Random(5)
PROMPTS = {f"r{i}": [RNG.randrange(3, 500) for _ in range(RNG.randrange(6, 40))] for i in range(10)}


def engine_for(tiny_llama, overlap: str, **kwargs) -> LLMEngine:
    kwargs.setdefault("num_blocks", 256)
    return LLMEngine(EngineConfig.from_kwargs(str(tiny_llama), dtype="float32", block_size=8,
                                              overlap_scheduling=overlap, **kwargs))


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]],
        arrivals_every: int = 0) -> dict:
    """Requests arrive one every ``arrivals_every`` steps (0: all at once); the pool's
    books are checked after every step and must balance at the end."""
    schedule: dict[int, list] = {}
    for index, (rid, (prompt, params)) in enumerate(requests.items()):
        schedule.setdefault(index * arrivals_every, []).append((rid, prompt, params))
    finals = run_arrivals(engine, schedule)
    assert engine.kv_manager.num_available_blocks == engine.num_blocks  # nothing leaked
    assert engine.runner._generators == {}  # every finished request was released
    return finals


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()


def test_auto_overlaps_on_cuda_only_and_on_is_refused_where_it_cannot_hold(tiny_llama) -> None:
    # On the CPU the CPU is the device: nothing to overlap (device auto: CUDA if present).
    assert engine_for(tiny_llama, "auto").overlap == torch.cuda.is_available()
    assert not engine_for(tiny_llama, "auto", device="cpu").overlap
    assert engine_for(tiny_llama, "on").overlap
    with pytest.raises(ValueError, match="speculative decoding"):
        engine_for(tiny_llama, "on", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="static batching"):
        engine_for(tiny_llama, "on", scheduling="static")
    with pytest.raises(ValueError, match="overlap_scheduling must be one of"):
        EngineConfig(overlap_scheduling="sometimes")


def test_greedy_tokens_equal_transformers(tiny_llama, hf_model) -> None:
    """Staggered arrivals and chunked prefill: decodes computing pending tokens share
    steps with prompt chunks. max_tokens differs per request and is met exactly."""
    requests = {rid: (prompt, SamplingParams(max_tokens=3 + i, temperature=0.0, ignore_eos=True))
                for i, (rid, prompt) in enumerate(PROMPTS.items())}
    engine = engine_for(tiny_llama, "on", max_num_batched_tokens=24, long_prefill_threshold=16)
    outputs = token_ids(run(engine, requests, arrivals_every=2))
    for rid, (prompt, params) in requests.items():
        assert outputs[rid] == hf_greedy_tokens(hf_model, prompt, params.max_tokens), rid


def test_the_step_after_is_launched_before_the_one_before_commits(tiny_llama) -> None:
    engine = engine_for(tiny_llama, "on")
    events: list[str] = []
    launch, finish, schedule = engine.runner.launch, engine.runner.finish, engine.scheduler.schedule

    def spy(name, function):
        def wrapper(*args):
            result = function(*args)
            step = (result if name == "schedule" else args[0] if name == "launch" else args[0].scheduled).step
            events.append(f"{name} {step}")
            return result
        return wrapper

    engine.runner.launch = spy("launch", launch)
    engine.runner.finish = spy("finish", finish)
    engine.scheduler.schedule = spy("schedule", schedule)
    engine.add_request(PROMPTS["r0"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    counts = []  # tokens the caller has seen after each call
    while engine.has_unfinished_requests():
        counts.append(max((len(output.outputs[0].token_ids) for output in engine.step()), default=0))
    # Step 1's token reaches the caller in the second call, one call late; the fourth
    # call schedules nothing and commits step 3 (the last token).
    assert counts == [0, 1, 2, 3]
    assert events == ["schedule 1", "launch 1", "schedule 2", "launch 2", "finish 1",
                      "schedule 3", "launch 3", "finish 2", "schedule 4", "finish 3"]


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_seeded_sampling_preemption_and_prefix_hits_give_the_synchronous_tokens(tiny_llama, prefix_cache) -> None:
    """A pool of 24 blocks of 8 holds about three requests: preemption happens while
    the victim's token is pending; shared prompt heads hit the prefix cache."""
    shared = PROMPTS["r9"][:16]
    requests = {rid: (shared + prompt if i % 2 else prompt,
                      SamplingParams(max_tokens=24, temperature=0.9, seed=i, ignore_eos=True, logprobs=2))
                for i, (rid, prompt) in enumerate(PROMPTS.items())}

    def finals(overlap: str) -> tuple[dict, LLMEngine]:
        engine = engine_for(tiny_llama, overlap, num_blocks=24, enable_prefix_caching=prefix_cache)
        return run(engine, requests, arrivals_every=1), engine

    reference, _ = finals("off")
    overlapped, engine = finals("on")
    assert engine.scheduler.num_preemptions > 0
    if prefix_cache:
        assert engine.stats().prefix_cache_hit_tokens > 0
    for rid in requests:
        expected, got = reference[rid].outputs[0], overlapped[rid].outputs[0]
        assert got.token_ids == expected.token_ids, rid
        assert len(got.logprobs) == len(got.token_ids)
        for position, (entry, want) in enumerate(zip(got.logprobs, expected.logprobs, strict=True)):
            assert sorted(entry) == sorted(want), (rid, position)  # the sampled token and the top 2
            for token, logprob in entry.items():
                assert (logprob.rank, logprob.decoded_token) == (want[token].rank, want[token].decoded_token)
                assert logprob.logprob == pytest.approx(want[token].logprob, abs=1e-5)


def test_a_stop_drops_the_step_already_launched_after_it(tiny_llama, hf_model) -> None:
    """The stop token's step has a successor in flight: its token is never appended."""
    prompt = PROMPTS["r3"]
    free_run = hf_greedy_tokens(hf_model, prompt, 12)
    stop_id = free_run[4]
    expected = free_run[:free_run.index(stop_id) + 1]
    engine = engine_for(tiny_llama, "on")
    finals = run(engine, {"s": (prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_id])),
                          "long": (PROMPTS["r4"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))})
    assert finals["s"].outputs[0].token_ids == expected
    assert finals["s"].outputs[0].finish_reason == "stop"
    assert finals["long"].outputs[0].token_ids == hf_greedy_tokens(hf_model, PROMPTS["r4"], 12)


def test_requests_that_need_the_last_token_run_beside_overlapped_ones(tiny_llama) -> None:
    """Penalties, min_tokens and a grammar read the previous token on the host: a step
    with them commits before the next is scheduled, the others still overlap."""
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    requests = {rid: (prompt, plain) for rid, prompt in list(PROMPTS.items())[:4]}
    requests["penalty"] = (PROMPTS["r5"], SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.8,
                                                          frequency_penalty=0.5, ignore_eos=True))
    requests["grammar"] = (PROMPTS["r6"], SamplingParams(max_tokens=10, temperature=0.0,
                                                          structured=StructuredOutput(regex="[a-z]{3,8}")))
    reference = token_ids(run(engine_for(tiny_llama, "off"), requests, arrivals_every=3))
    engine = engine_for(tiny_llama, "on")
    overlapped_steps = []
    finish = engine.runner.finish

    def recording(launched):
        overlapped_steps.append(engine._in_flight is None and launched.overlappable)
        return finish(launched)

    engine.runner.finish = recording
    assert token_ids(run(engine, requests, arrivals_every=3)) == reference
    assert any(overlapped_steps) and not all(overlapped_steps)


def test_an_abort_while_its_step_is_in_flight_frees_everything(tiny_llama, hf_model) -> None:
    engine = engine_for(tiny_llama, "on")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for rid in ("a", "b", "c"):
        engine.add_request(PROMPTS[f"r{ord(rid) - 97}"], params, request_id=rid)
    finals = {}
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None and any(item.request.request_id == "b"
                                                 for item in engine._in_flight.scheduled.scheduled)
    engine.abort_request("b")
    engine.check_integrity()
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.check_integrity()
    assert set(finals) == {"a", "c"}
    assert finals["a"].outputs[0].token_ids == hf_greedy_tokens(hf_model, PROMPTS["r0"], 16)
    assert finals["c"].outputs[0].token_ids == hf_greedy_tokens(hf_model, PROMPTS["r2"], 16)
    assert engine.kv_manager.num_available_blocks == engine.num_blocks


def test_a_failing_output_fails_its_request_alone(tiny_llama, monkeypatch) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = {rid: (prompt, params) for rid, prompt in list(PROMPTS.items())[:5]}
    reference = token_ids(run(engine_for(tiny_llama, "off"), requests))
    engine = engine_for(tiny_llama, "on")
    fail_output_of(engine, monkeypatch, "r2", at_token=4)
    finals = run(engine, requests)
    assert finals["r2"].outputs[0].finish_reason == "error"
    assert isinstance(finals["r2"].error, RequestError) and "UnicodeDecodeError" in finals["r2"].error.message
    assert {rid: o.outputs[0].token_ids for rid, o in finals.items() if rid != "r2"} == \
        {rid: tokens for rid, tokens in reference.items() if rid != "r2"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device's queue exists on a GPU only")
def test_cuda_launch_never_waits_for_the_device(tiny_llama, hf_model) -> None:
    """torch's sync debug mode raises at any synchronisation (a blocking copy, .item(),
    nonzero, a stream sync) inside every launch after the first (the first compiles the
    kernels): the host never waits for the device between finishes."""
    engine = engine_for(tiny_llama, "on", device="cuda")
    launch, launches = engine.runner.launch, []

    def strict(output):
        launches.append(output.step)
        if len(launches) > 1:
            torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(output)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    engine.runner.launch = strict
    requests = {rid: (prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
                for rid, prompt in list(PROMPTS.items())[:4]}
    outputs = token_ids(run(engine, requests, arrivals_every=1))
    assert len(launches) > 8
    for rid, (prompt, params) in requests.items():
        assert outputs[rid] == hf_greedy_tokens(hf_model, prompt, params.max_tokens), rid
