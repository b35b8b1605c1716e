"""A failure that belongs to one request fails that request alone: it finishes with an
error naming what went wrong, its blocks are freed at once, and every other request
of the same steps produces exactly the tokens it produces without the failure."""

from __future__ import annotations

import pytest
from helpers_engine import fail_output_of, run_arrivals

from kvloom import SamplingParams
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.request import RequestError
from kvloom.structured.constraint import StructuredOutput
from kvloom.structured.matcher import GrammarMatcher

PROMPTS = {f"r{i}": [(13 * i + 7 * j) % 500 + 3 for j in range(5 + 4 * i)] for i in range(6)}
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def engine_for(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(str(tiny_llama), dtype="float32", num_blocks=64))


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    finals = run_arrivals(engine, {0: [(rid, prompt, params) for rid, (prompt, params) in requests.items()]})
    assert engine.kv_manager.num_available_blocks == engine.num_blocks  # nothing leaked
    return finals


@pytest.fixture(scope="module")
def reference(tiny_llama) -> dict[str, list[int]]:
    finals = run(engine_for(tiny_llama), {rid: (prompt, PARAMS) for rid, prompt in PROMPTS.items()})
    return {rid: output.outputs[0].token_ids for rid, output in finals.items()}


def test_a_failing_output_step_fails_only_its_request(tiny_llama, reference, monkeypatch) -> None:
    engine = engine_for(tiny_llama)
    fail_output_of(engine, monkeypatch, "r2", at_token=4)
    finals = run(engine, {rid: (prompt, PARAMS) for rid, prompt in PROMPTS.items()})
    failed = finals["r2"]
    assert failed.outputs[0].finish_reason == "error"
    assert isinstance(failed.error, RequestError) and not failed.error.caused_by_request
    assert "UnicodeDecodeError" in failed.error.message
    for rid in PROMPTS:
        if rid != "r2":
            assert finals[rid].outputs[0].token_ids == reference[rid]
            assert finals[rid].outputs[0].finish_reason == "length"


def test_a_grammar_that_fails_mid_generation_fails_only_its_request(tiny_llama, reference,
                                                                       monkeypatch) -> None:
    engine = engine_for(tiny_llama)
    advance = GrammarMatcher.advance

    def failing(self, token_id, room, accepted=()):
        if self.num_consumed == 2:
            raise ValueError("too many expressions constructed (injected)")
        return advance(self, token_id, room, accepted)

    monkeypatch.setattr(GrammarMatcher, "advance", failing)
    constrained = SamplingParams(max_tokens=12, temperature=0.0,
                                 structured=StructuredOutput(regex="[a-z ]{1,40}"))
    requests = {rid: (prompt, PARAMS) for rid, prompt in PROMPTS.items()}
    requests["g"] = ([5, 6, 7], constrained)
    finals = run(engine, requests)
    assert finals["g"].outputs[0].finish_reason == "error"
    assert "too many expressions" in finals["g"].error.message
    assert len(finals["g"].outputs[0].token_ids) == 2  # the failing step's token is not kept
    assert {rid: finals[rid].outputs[0].token_ids for rid in PROMPTS} == reference


def test_bad_values_are_refused_at_admission(tiny_llama) -> None:
    engine = engine_for(tiny_llama)
    for params, message in [
        (dict(seed=2 ** 80), "seed must be < 2\\*\\*64"),
        (dict(seed=2 ** 64), "seed must be < 2\\*\\*64"),
        (dict(seed=-2 ** 70), "seed must be >= "),
        (dict(temperature=float("inf")), "temperature must be a finite number"),
        (dict(top_p=float("nan")), "top_p must be a finite number"),
        (dict(stop=["x"] * 65), "stop may hold at most 64"),
        (dict(stop=["y" * 1025]), "stop strings may be at most 1024"),
        (dict(ignore_eos="no"), "ignore_eos must be a bool, got 'no'"),  # a truthy string, before
        (dict(skip_special_tokens=0), "skip_special_tokens must be a bool"),
        (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output must be a bool"),
        (dict(stop={"a": 1}), "stop must be a string or a list of strings, got dict"),
    ]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**params)
    with pytest.raises(ValueError, match="stop_token_ids must be token ids in \\[0, 512\\)"):
        engine.add_request([1, 2], SamplingParams(stop_token_ids=[5, 512]))
    with pytest.raises(ValueError, match="logit_bias must be token ids in \\[0, 512\\)"):
        engine.add_request([1, 2], SamplingParams(logit_bias={5: 1.0, 512: 2.0}))
    with pytest.raises(ValueError, match="regex too complex to follow"):
        engine.add_request([1, 2], SamplingParams(structured=StructuredOutput(regex="(a{1000}){1000}")))
    assert not engine.has_unfinished_requests()
    engine.check_integrity()


def test_negative_and_large_seeds_are_accepted_and_reproducible(tiny_llama) -> None:
    engine = engine_for(tiny_llama)
    sampled = {}
    for name, seed in [("minus one", -1), ("max", 2 ** 64 - 1), ("minus one again", -1)]:
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True)
        sampled[name] = run(engine, {name: ([4, 5, 6], params)})[name].outputs[0].token_ids
    # -1 stands for 2**64 - 1 (its 64-bit pattern): the same generator, the same tokens.
    assert sampled["minus one"] == sampled["max"] == sampled["minus one again"]


def test_thousands_of_choices_are_served(tiny_llama) -> None:
    engine = engine_for(tiny_llama)
    options = [f"option {i}" for i in range(5000)]
    params = SamplingParams(max_tokens=8, temperature=0.0, structured=StructuredOutput(choice=options))
    final = run(engine, {"c": ([7, 8, 9], params)})["c"]
    assert final.outputs[0].finish_reason == "stop"
    assert final.outputs[0].text in options


def test_samples_of_a_seed_near_the_top_wrap_to_64_bits(tiny_llama) -> None:
    from kvloom import LLM

    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64)
    params = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=2 ** 64 - 2, ignore_eos=True)
    outputs = llm.generate([[4, 5, 6]], params)[0].outputs
    # Sample 2's seed wraps to 0: the same tokens as a request seeded with 0.
    alone = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=4, temperature=1.0, seed=0, ignore_eos=True))
    assert outputs[2].token_ids == alone[0].outputs[0].token_ids


def _assert_clean_and_serving(llm, reference) -> None:
    """Nothing of an interrupted call is left, and the next call gives the clean run's tokens."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_available_blocks == engine.num_blocks
    engine.check_integrity()
    outputs = llm.generate([PROMPTS[rid] for rid in PROMPTS], PARAMS)
    assert [output.outputs[0].token_ids for output in outputs] == [reference[rid] for rid in PROMPTS]


@pytest.mark.parametrize("raised", [KeyboardInterrupt, RuntimeError], ids=["ctrl-c", "engine fault"])
def test_a_generate_ended_by_a_step_aborts_its_requests(tiny_llama, reference, monkeypatch, raised) -> None:
    """A Ctrl-C or an engine fault in the third step ends LLM.generate; before, its requests
    stayed running, and each later call stepped them again (and failed again)."""
    from kvloom import LLM

    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64)
    launch, calls = llm.engine.runner.launch, []

    def failing(scheduled):
        calls.append(1)
        if len(calls) == 3:
            raise raised("injected")
        return launch(scheduled)

    monkeypatch.setattr(llm.engine.runner, "launch", failing)
    with pytest.raises(raised, match="injected"):
        llm.generate([PROMPTS[rid] for rid in PROMPTS], PARAMS)
    _assert_clean_and_serving(llm, reference)


def test_a_generate_interrupted_while_adding_aborts_the_half_added_request(tiny_llama, reference,
                                                                           monkeypatch) -> None:
    """Ctrl-C between the scheduler taking a request and the output processor knowing it:
    the request is aborted too (its id was owned before it was added)."""
    from kvloom import LLM

    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64)
    add, calls = llm.engine.output_processor.add, []

    def interrupted(request):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return add(request)

    monkeypatch.setattr(llm.engine.output_processor, "add", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPTS[rid] for rid in PROMPTS], PARAMS)
    monkeypatch.undo()
    _assert_clean_and_serving(llm, reference)


def test_generate_never_takes_an_id_a_caller_chose(tiny_llama, reference) -> None:
    """A request added straight to the engine as "1", then generate(): its ids came from
    the engine's counter ("0", "1"), so it was refused as a duplicate and, cleaning up,
    aborted the caller's request "1"."""
    from kvloom import LLM

    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64)
    longer = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)  # outlasts the generate call
    llm.engine.add_request(PROMPTS["r0"], longer, request_id="1")
    outputs = llm.generate([PROMPTS["r1"], PROMPTS["r2"]], PARAMS)
    assert [o.outputs[0].token_ids for o in outputs] == [reference["r1"], reference["r2"]]
    assert "1" in llm.engine.scheduler.requests  # the caller's, still there for it to step
    finals = run(llm.engine, {})
    assert finals["1"].outputs[0].token_ids[:12] == reference["r0"]


@pytest.mark.parametrize("priority", [[None, 1], ["x", 1], [1.5, 1], [True, 1], [1]])
def test_bad_priorities_are_refused_before_anything_runs(tiny_llama, reference, priority) -> None:
    from kvloom import LLM

    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64, policy="priority")
    with pytest.raises(ValueError, match="priority must be an integer|priorities for 2 prompts"):
        llm.generate([PROMPTS["r0"], PROMPTS["r1"]], PARAMS, priority=priority)
    _assert_clean_and_serving(llm, reference)
