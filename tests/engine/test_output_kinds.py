"""SamplingParams.output_kind (vLLM's RequestOutputKind): CUMULATIVE outputs every step,
DELTA outputs only each step's new part, FINAL_ONLY one output when the request ends,
its text detokenized once then unless a stop string needs it per token. Each kind's
result is checked against the tokenizer's own decode and against the CUMULATIVE run."""

from __future__ import annotations

from typing import Any

import pytest
from helpers_engine import run_arrivals

from kvloom import LLM, SamplingParams
from kvloom.engine.output import RequestOutput
from kvloom.engine.output_processor import OutputProcessor
from kvloom.request import Request, RequestStatus
from kvloom.sampling_params import RequestOutputKind
from kvloom.tokenizer import Tokenizer

KINDS = list(RequestOutputKind)
TEXTS = ["Hello world, and a longer tail of words.",
         "你好，世界！这是一个测试。",
         "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
         "mixed: café naïve — “quotes” … 日本語"]


@pytest.fixture(scope="module")
def smol(default_gguf_reader: Any) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(default_gguf_reader)


def stream(tokenizer: Tokenizer, output: list[int], kind: RequestOutputKind,
           stop: list[str] | None = None) -> list[RequestOutput]:
    """The outputs OutputProcessor reports for a request whose tokens arrive one a step,
    as the scheduler's stop check and the engine's commit drive it."""
    processor = OutputProcessor(tokenizer)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=len(output), output_kind=kind, stop=stop or []))
    processor.add(request)
    outputs = []
    for index, token_id in enumerate(output):
        request.append_output_token(token_id)
        stop_string = processor.add_token(request, token_id)
        if stop_string is not None:
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop_string
        elif index == len(output) - 1:
            request.status = RequestStatus.FINISHED_LENGTH
        result = processor.make_output(request)
        if result is not None:
            outputs.append(result)
        if request.is_finished:
            break
    return outputs


@pytest.mark.parametrize("text", TEXTS)
def test_each_kind_reports_the_text_decode_gives(smol: Tokenizer, text: str) -> None:
    """Multi-byte characters spread over byte-level tokens: the cumulative text, the
    deltas joined and the one final output all equal decode() of the tokens."""
    output = smol.encode(text, add_special_tokens=False)
    expected = smol.decode(output)
    cumulative = stream(smol, output, RequestOutputKind.CUMULATIVE)
    delta = stream(smol, output, RequestOutputKind.DELTA)
    final = stream(smol, output, RequestOutputKind.FINAL_ONLY)
    assert len(cumulative) == len(delta) == len(output)
    assert cumulative[-1].outputs[0].text == expected
    assert cumulative[-1].outputs[0].token_ids == output
    assert "".join(o.outputs[0].text for o in delta) == expected
    assert [t for o in delta for t in o.outputs[0].token_ids] == output
    assert [o.outputs[0].text for o in delta] == [o.outputs[0].delta_text for o in cumulative]
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].text == expected
    assert final[0].outputs[0].token_ids == output
    assert final[0].outputs[0].finish_reason == "length"


def test_an_unfinished_character_at_the_end_is_released(smol: Tokenizer) -> None:
    """An output cut inside a character (its last byte-level token missing): every kind
    ends with decode()'s text, replacement character included."""
    output = smol.encode("ok 😀", add_special_tokens=False)[:-1]
    expected = smol.decode(output)
    assert expected.endswith("\ufffd")
    for kind in KINDS:
        outputs = stream(smol, output, kind)
        text = "".join(o.outputs[0].text for o in outputs) if kind is RequestOutputKind.DELTA \
            else outputs[-1].outputs[0].text
        assert text == expected, kind


def test_final_only_with_a_stop_string_cuts_where_cumulative_does(smol: Tokenizer) -> None:
    """A stop string needs the text token by token, so FINAL_ONLY then detokenizes as it
    goes: the request stops at the same token, with the same cut text."""
    output = smol.encode("alpha beta gamma delta epsilon", add_special_tokens=False)
    cumulative = stream(smol, output, RequestOutputKind.CUMULATIVE, stop=["gamma"])
    final = stream(smol, output, RequestOutputKind.FINAL_ONLY, stop=["gamma"])
    assert len(final) == 1
    assert final[0].outputs[0].text == cumulative[-1].outputs[0].text == "alpha beta "
    assert final[0].outputs[0].token_ids == cumulative[-1].outputs[0].token_ids
    assert final[0].outputs[0].stop_reason == "gamma"
    assert len(final[0].outputs[0].token_ids) < len(output)


def test_bad_output_kinds_are_refused_by_name() -> None:
    for bad in (3, -1, "FINAL_ONLY", True, None, 1.5, 2.0, [2], {}):
        with pytest.raises(ValueError, match="output_kind"):
            SamplingParams(output_kind=bad)
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE


def test_engine_outputs_per_kind_match_the_cumulative_run(tiny_llama) -> None:
    """One batch of requests, with logprobs and a stop string among them, run once per
    kind: CUMULATIVE's tokens are each request's alone and its text is decode()'s; the
    same batch as DELTA joins into CUMULATIVE's results and as FINAL_ONLY reports them
    once, at the end (logprobs too, kept across the steps); no block is left held."""
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=128)
    engine = llm.engine
    prompts = {"a": [10, 20, 30], "b": [7] * 9, "c": [5, 6, 7, 8, 9, 11], "d": [40, 41]}
    common = dict(temperature=0.0, ignore_eos=True, skip_special_tokens=False)
    params = {"a": dict(max_tokens=12), "b": dict(max_tokens=7, logprobs=2), "c": dict(max_tokens=16),
              "d": dict(max_tokens=10, logprobs=1)}
    free = run_arrivals(engine, {0: [("c", prompts["c"], SamplingParams(**common, **params["c"]))]})
    stop_text = free["c"].outputs[0].text[4:7]
    assert len(stop_text) == 3
    alone = {rid: run_arrivals(engine, {0: [(rid, prompts[rid], SamplingParams(
        **common, **params[rid], stop=[stop_text] if rid == "c" else []))]})[rid].outputs[0] for rid in prompts}
    assert alone["c"].stop_reason == stop_text
    results: dict[RequestOutputKind, dict[str, list[RequestOutput]]] = {}
    for kind in KINDS:
        seen: dict[str, list[RequestOutput]] = {rid: [] for rid in prompts}
        for rid in prompts:
            engine.add_request(prompts[rid], SamplingParams(**common, **params[rid], output_kind=kind,
                                                            stop=[stop_text] if rid == "c" else []),
                               request_id=f"{kind.name}-{rid}")
        while engine.has_unfinished_requests():
            for output in engine.step():
                seen[output.request_id.split("-")[1]].append(output)
            engine.check_integrity()
        results[kind] = seen
    for rid in prompts:
        cumulative = results[RequestOutputKind.CUMULATIVE][rid]
        expected = cumulative[-1].outputs[0]
        assert expected.token_ids == alone[rid].token_ids
        assert expected.text == alone[rid].text
        if rid != "c":
            assert expected.text == llm.tokenizer.decode(expected.token_ids, skip_special_tokens=False)
        assert (expected.logprobs is None) == ("logprobs" not in params[rid])
        delta = results[RequestOutputKind.DELTA][rid]
        final = results[RequestOutputKind.FINAL_ONLY][rid]
        for outputs in (cumulative, delta, final):
            assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
            assert (outputs[-1].outputs[0].finish_reason, outputs[-1].outputs[0].stop_reason) == \
                (expected.finish_reason, expected.stop_reason)
        assert len(delta) == len(cumulative) and len(final) == 1
        assert "".join(o.outputs[0].text for o in delta) == expected.text
        assert [t for o in delta for t in o.outputs[0].token_ids] == expected.token_ids
        if expected.logprobs is not None:
            assert [p for o in delta for p in o.outputs[0].logprobs] == expected.logprobs
        last = final[0].outputs[0]
        assert (last.text, last.token_ids, last.logprobs) == (expected.text, expected.token_ids, expected.logprobs)
    assert engine.kv_manager.num_available_blocks == engine.kv_manager.num_blocks


def test_llm_generate_runs_final_only_and_keeps_its_results(tiny_llama) -> None:
    """LLM.generate asks for final outputs only, whatever the params say, and returns
    what a CUMULATIVE run of the same requests ends with (n > 1 included)."""
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=128)
    params = SamplingParams(max_tokens=9, temperature=0.8, seed=7, n=2, ignore_eos=True, logprobs=1,
                            output_kind=RequestOutputKind.DELTA)
    generated = llm.generate([[3, 4, 5], [9, 9]], params)
    kinds = []
    add_request = llm.engine.add_request
    llm.engine.add_request = lambda prompt, p, **kw: (kinds.append(p.output_kind), add_request(prompt, p, **kw))[1]
    llm.generate([[1, 2]], SamplingParams(max_tokens=2))
    assert kinds == [RequestOutputKind.FINAL_ONLY]
    for index, prompt in enumerate([[3, 4, 5], [9, 9]]):
        for sample in range(2):
            alone = run_arrivals(llm.engine, {0: [("x", prompt, SamplingParams(
                max_tokens=9, temperature=0.8, seed=7 + sample, ignore_eos=True, logprobs=1))]})["x"].outputs[0]
            got = generated[index].outputs[sample]
            assert (got.text, got.token_ids) == (alone.text, alone.token_ids)
            # A logprob per token, kept across the steps (float32 matmuls may round them
            # differently in another batch: the values are compared to a tolerance).
            assert [next(iter(entry)) for entry in got.logprobs] == got.token_ids
            assert [entry[t].logprob for entry, t in zip(got.logprobs, got.token_ids, strict=True)] == \
                pytest.approx([entry[t].logprob for entry, t in zip(alone.logprobs, alone.token_ids, strict=True)],
                              abs=1e-4)


def test_progress_reports_every_request_every_step_whatever_its_kind(tiny_llama) -> None:
    """LLMEngine.progress() after each step: one entry per request that gained a token,
    FINAL_ONLY ones included (they have no output until the end): tokens 1, 2, ... n one
    a step, the first flagged, the finish reason only on the last, prompt and cache
    counts as the final output reports them."""
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=128)
    engine = llm.engine
    wanted = {"final": (RequestOutputKind.FINAL_ONLY, 5), "delta": (RequestOutputKind.DELTA, 3),
              "cumulative": (RequestOutputKind.CUMULATIVE, 4)}
    prompt = list(range(3, 40))
    for rid, (kind, max_tokens) in wanted.items():
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=kind),
                           request_id=rid)
    seen: dict[str, list] = {rid: [] for rid in wanted}
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in wanted}
    while engine.has_unfinished_requests():
        step_outputs = engine.step()
        for output in step_outputs:
            outputs[output.request_id].append(output)
        progress = engine.progress()
        assert len({entry.request_id for entry in progress}) == len(progress)
        for entry in progress:
            seen[entry.request_id].append(entry)
    for rid, (kind, max_tokens) in wanted.items():
        entries = seen[rid]
        assert [e.num_new_tokens for e in entries] == [1] * max_tokens
        assert [e.num_output_tokens for e in entries] == list(range(1, max_tokens + 1))
        assert [e.is_first_token for e in entries] == [True] + [False] * (max_tokens - 1)
        assert [e.finish_reason for e in entries] == [None] * (max_tokens - 1) + ["length"]
        assert all(e.num_prompt_tokens == len(prompt) for e in entries)
        final = outputs[rid][-1]
        assert final.finished and len(final.outputs[0].token_ids if kind is not RequestOutputKind.DELTA
                                      else [t for o in outputs[rid] for t in o.outputs[0].token_ids]) == max_tokens
        assert len(outputs[rid]) == (1 if kind is RequestOutputKind.FINAL_ONLY else max_tokens)
        assert all(e.num_cached_tokens == final.num_cached_tokens for e in entries)
        assert entries[0].timeline is final.metrics and final.metrics.first_token_time is not None
    assert engine.kv_manager.num_available_blocks == engine.kv_manager.num_blocks


def test_progress_is_empty_on_steps_that_only_compute_a_prompt(tiny_llama) -> None:
    """A 90-token prompt in 32-token chunks: two steps move no request (no entry), the
    third computes the rest and samples the only token."""
    engine = LLM(str(tiny_llama), dtype="float32", num_blocks=128, max_num_batched_tokens=32,
                 long_prefill_threshold=32).engine
    engine.add_request(list(range(100, 190)), SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY),
                       request_id="long")
    reports = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        reports.append(([o.request_id for o in outputs], [(e.request_id, e.num_new_tokens, e.finish_reason)
                                                          for e in engine.progress()]))
    assert reports == [([], []), ([], []), (["long"], [("long", 1, "length")])]
