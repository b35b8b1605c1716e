"""Driving an engine in tests: requests added at given steps, the pool's books checked
after every step."""

from __future__ import annotations

from typing import Any

from kvloom import LLM
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.engine.output import RequestOutput
from kvloom.sampling_params import SamplingParams

Arrival = tuple[str, list[int], SamplingParams]  # request id, prompt token ids, parameters


def run_arrivals(engine: LLMEngine, arrivals: dict[int, list[Arrival]]) -> dict[str, RequestOutput]:
    """Step until every request finished, adding ``arrivals[s]`` before step ``s``;
    ``check_integrity()`` after every step. Returns each request's final output."""
    finals: dict[str, RequestOutput] = {}
    step = 0
    while engine.has_unfinished_requests() or any(s >= step for s in arrivals):
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(prompt, params, request_id=request_id)
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        engine.check_integrity()
        step += 1
    return finals


def token_ids(finals: dict[str, RequestOutput]) -> dict[str, list[int]]:
    return {request_id: output.outputs[0].token_ids for request_id, output in finals.items()}


def fail_output_of(engine: LLMEngine, monkeypatch, request_id: str, at_token: int) -> None:
    """Make detokenizing ``request_id``'s ``at_token``-th token (1-based) raise, as a
    broken byte sequence would: a failure that belongs to that request alone."""
    add_token = engine.output_processor.add_token
    calls = {request_id: 0}

    def flaky(request, token_id):
        if request.request_id == request_id:
            calls[request_id] += 1
            if calls[request_id] == at_token:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return add_token(request, token_id)

    monkeypatch.setattr(engine.output_processor, "add_token", flaky)


def bf16_alone_equals_batched(path: str, prompts: list[list[int]], params: SamplingParams,
                              **engine_kwargs: Any) -> LLMEngine:
    """Each prompt's bf16 tokens run alone equal them in one engine with the prompts
    arriving two steps apart and prefills chunked at 24 tokens (the kernels are
    batch-invariant); returns that engine, for what the caller asks of it after.
    ``engine_kwargs``: for both engines (a device, a backend)."""
    def engine(**kwargs: Any) -> LLMEngine:
        return LLMEngine(EngineConfig.from_kwargs(path, dtype="bfloat16", block_size=16, num_blocks=128,
                                                  **engine_kwargs, **kwargs))

    alone = {}
    for index, prompt in enumerate(prompts):
        alone[f"r{index}"] = token_ids(run_arrivals(engine(), {0: [(f"r{index}", prompt, params)]}))[f"r{index}"]
    together = engine(max_num_batched_tokens=24)
    arrivals = {2 * index: [(f"r{index}", prompt, params)] for index, prompt in enumerate(prompts)}
    assert token_ids(run_arrivals(together, arrivals)) == alone
    return together


def layer_skip_keeps_greedy_tokens(path: str, prompts: list[list[int]], num_layers: int) -> LLM:
    """The model's first ``num_layers`` layers draft for it (layer skip): its greedy tokens
    stay those it gives without drafts, drafts were proposed, and the draft is the model's
    own class (its forward, not Llama's). Returns the drafting LLM."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = LLM(path, dtype="float32", num_blocks=64).generate(prompts, params)
    drafted = LLM(path, dtype="float32", num_blocks=64,
                  speculative_config={"method": "layer_skip", "num_layers": num_layers, "num_speculative_tokens": 3})
    outputs = drafted.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert drafted.engine.stats().num_draft_tokens > 0
    model = drafted.engine.model
    assert type(model.first_layers(num_layers)) is type(model)
    return drafted
