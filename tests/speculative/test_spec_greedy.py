"""Speculative decoding with greedy requests: every proposer gives exactly the tokens,
text and logprobs of speculation off, alone and batched, through chunked prefill,
prefix hits, preemption, stops and aborts; the pool's books balance after every step.

The reference is the same engine with speculation off: in bf16 on CPU (the default
configuration) a row's logits do not depend on the other rows of its step (the
batch-invariant GEMM, one attention kernel for chunks and decodes), so a draft
verified in a chunk of k + 1 rows sees exactly the logits a plain decode would.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvloom import SamplingParams
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.engine.output import RequestOutput

PROPOSERS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
    "layer_skip": {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3},
    # The target as its own draft: every draft is accepted (the longest runs).
    # (A draft model as big as the target never pays: adaptive off makes it draft anyway.)
    "draft_same": {"method": "draft", "num_speculative_tokens": 5, "adaptive": False},
    # Another random model: almost every draft is rejected (rollback every step).
    "draft_other": {"method": "draft", "num_speculative_tokens": 2, "adaptive": False},
}


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers_models import write_tiny_hf_model
    return write_tiny_hf_model(tmp_path_factory.mktemp("other-llama"), arch="llama", seed=7)


def speculative(name: str, target: Path, other: Path) -> dict:
    config = dict(PROPOSERS[name])
    if name == "draft_same":
        config["model"] = str(target)
    elif name == "draft_other":
        config["model"] = str(other)
    return config


def make_engine(path: Path, **kwargs) -> LLMEngine:
    args = dict(block_size=16, num_blocks=256)
    args.update(kwargs)
    return LLMEngine(EngineConfig.from_kwargs(str(path), **args))


def run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams | dict[str, SamplingParams],
        arrival_step: dict[str, int] | None = None) -> dict[str, RequestOutput]:
    """Step to the end, checking the books after every step and that the streamed
    deltas add up to each final output."""
    finals: dict[str, RequestOutput] = {}
    streamed: dict[str, tuple[str, list[int]]] = {}
    arrival_step = arrival_step or {}
    step = 0
    while engine.has_unfinished_requests() or len(finals) < len(prompts):
        for request_id, prompt in prompts.items():
            if arrival_step.get(request_id, 0) == step:
                chosen = params[request_id] if isinstance(params, dict) else params
                engine.add_request(prompt, chosen, request_id=request_id)
        for output in engine.step():
            text, tokens = streamed.get(output.request_id, ("", []))
            completion = output.outputs[0]
            streamed[output.request_id] = (text + completion.delta_text, tokens + completion.delta_token_ids)
            if output.finished:
                finals[output.request_id] = output
        engine.check_integrity()
        step += 1
    for request_id, output in finals.items():
        assert streamed[request_id] == (output.outputs[0].text, output.outputs[0].token_ids)
    assert engine.kv_manager.usage == 0.0  # every block free or idle in the prefix cache
    return finals


def summary(finals: dict[str, RequestOutput]) -> dict[str, tuple]:
    return {rid: (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                  o.outputs[0].stop_reason) for rid, o in finals.items()}


def repetitive_prompts(count: int, seed: int = 0) -> dict[str, list[int]]:
    """Prompts that repeat a phrase, so that prompt lookup finds matches."""
    rng = random.Random(seed)
    prompts = {}
    for i in range(count):
        phrase = [rng.randrange(3, 512) for _ in range(rng.randrange(5, 20))]
        prompts[f"r{i}"] = phrase * rng.randrange(2, 5) + [rng.randrange(3, 512) for _ in range(3)]
    return prompts


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_alone_and_batched_match_speculation_off(tiny_llama, other_llama, name) -> None:
    prompts = repetitive_prompts(6)
    params = {rid: SamplingParams(max_tokens=12 + 7 * i, temperature=0.0, ignore_eos=True, logprobs=2)
              for i, rid in enumerate(prompts)}
    reference = run(make_engine(tiny_llama), prompts, params)
    engine = make_engine(tiny_llama, speculative_config=speculative(name, tiny_llama, other_llama))
    batched = run(engine, prompts, params)
    assert summary(batched) == summary(reference)
    for rid, output in batched.items():
        # Accepted drafts report the logprobs the target gave them, as plain decoding does.
        assert output.outputs[0].logprobs == reference[rid].outputs[0].logprobs
        assert len(output.outputs[0].token_ids) == params[rid].max_tokens  # never more
    stats = engine.stats()
    assert stats.num_draft_tokens > 0
    if name == "draft_same":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    alone_id = "r3"
    alone = run(make_engine(tiny_llama, speculative_config=speculative(name, tiny_llama, other_llama)),
                {alone_id: prompts[alone_id]}, params)
    assert summary(alone)[alone_id] == summary(reference)[alone_id]


@pytest.mark.parametrize("name", ["ngram", "draft_same", "layer_skip"])
def test_chunked_prefill_prefix_hits_and_preemption(tiny_llama, other_llama, name) -> None:
    rng = random.Random(5)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    prompts = {f"p{i}": shared * 2 + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 9))]
               for i in range(4)}
    prompts.update(repetitive_prompts(4, seed=6))  # their own prompts: the pool runs out
    arrivals = {rid: i for i, rid in enumerate(prompts)}  # later ones hit the cached prefix
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    tight = dict(max_num_batched_tokens=48, long_prefill_threshold=24, num_blocks=16)
    reference = run(make_engine(tiny_llama, num_blocks=512), prompts, params, arrivals)
    engine = make_engine(tiny_llama, speculative_config=speculative(name, tiny_llama, other_llama),
                         trace=True, **tight)
    result = run(engine, prompts, params, arrivals)
    assert summary(result) == summary(reference)
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats().prefix_cache_hit_tokens > 0
    assert engine.stats().num_draft_tokens > 0
    assert any(entry.num_tokens > 1 and entry.kind == "decode" and entry.num_draft_tokens
               for record in engine.scheduler.trace.records for entry in record.scheduled)
    # With the prefix cache off every block returns to the free list.
    plain = make_engine(tiny_llama, speculative_config=speculative(name, tiny_llama, other_llama),
                        enable_prefix_caching=False, **tight)
    assert summary(run(plain, prompts, params, arrivals)) == summary(reference)
    assert plain.kv_manager.pool.num_free_blocks == 16


def test_stops_inside_an_accepted_run(tiny_llama, other_llama) -> None:
    prompts = repetitive_prompts(4, seed=2)
    free = run(make_engine(tiny_llama), prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    params = {}
    for rid, output in free.items():
        tokens, text = output.outputs[0].token_ids, output.outputs[0].text
        if rid == "r0":  # a stop token in the middle of the output
            params[rid] = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[tokens[17]])
        elif rid == "r1":  # a stop string from the middle of the text
            params[rid] = SamplingParams(max_tokens=40, temperature=0.0, stop=[text[len(text) // 2:][:3]])
        else:
            params[rid] = SamplingParams(max_tokens=9 + int(rid[1:]), temperature=0.0, ignore_eos=True)
    reference = run(make_engine(tiny_llama), prompts, params)
    for name in ("draft_same", "ngram"):
        engine = make_engine(tiny_llama, speculative_config=speculative(name, tiny_llama, other_llama))
        assert summary(run(engine, prompts, params)) == summary(reference)
    assert reference["r0"].outputs[0].finish_reason == "stop"
    assert reference["r1"].outputs[0].stop_reason == params["r1"].stop[0]


def test_abort_mid_speculation_leaves_the_rest_exact(tiny_llama, other_llama) -> None:
    prompts = repetitive_prompts(3, seed=4)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    reference = run(make_engine(tiny_llama), prompts, params)
    engine = make_engine(tiny_llama, speculative_config=speculative("draft_same", tiny_llama, other_llama),
                         enable_prefix_caching=False)
    for rid, prompt in prompts.items():
        engine.add_request(prompt, params, request_id=rid)
    finals: dict[str, RequestOutput] = {}
    aborted = False
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        request = engine.scheduler.requests.get("r1")
        if not aborted and request is not None and request.num_draft_tokens > 8:
            # Drafts verified; its shadow in the draft model holds guesses past them.
            assert engine.proposer is not None and "r1" in engine.proposer._shadows
            engine.abort_request("r1")
            aborted = True
        engine.check_integrity()
    assert aborted
    assert "r1" not in finals or finals["r1"].outputs[0].finish_reason == "abort"
    for rid in ("r0", "r2"):
        assert finals[rid].outputs[0].token_ids == reference[rid].outputs[0].token_ids
    assert engine.kv_manager.pool.num_free_blocks == engine.num_blocks
    assert engine.proposer is not None and not engine.proposer._shadows  # the draft's KV freed too


@pytest.mark.parametrize("name", ["ngram", "draft_same"])
def test_bad_words_and_allowed_token_ids_match_speculation_off(tiny_llama, other_llama, name) -> None:
    """A draft row sees the drafts before it as output: a bad word completed across a
    draft is blocked there as it would be a step later without speculation."""
    prompts = repetitive_prompts(4, seed=3)
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    unrestricted = run(make_engine(tiny_llama), prompts, plain)
    # Bad words that the unrestricted outputs contain: each output's tokens 4-5 and 9.
    words = [tokens[4:6] for tokens in (o.outputs[0].token_ids for o in unrestricted.values())]
    words += [[o.outputs[0].token_ids[9]] for o in unrestricted.values()][:2]
    allowed = sorted({t for o in unrestricted.values() for t in o.outputs[0].token_ids})[:40]
    params = {rid: SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, bad_words_token_ids=words,
                                  allowed_token_ids=allowed if i % 2 else None)
              for i, rid in enumerate(prompts)}
    reference = run(make_engine(tiny_llama), prompts, params)
    engine = make_engine(tiny_llama, speculative_config=speculative(name, tiny_llama, other_llama))
    speculated = run(engine, prompts, params)
    assert summary(speculated) == summary(reference)
    assert engine.stats().num_accepted_tokens > 0  # drafts ran, and some were kept
    for rid, output in reference.items():
        tokens = output.outputs[0].token_ids
        assert tokens != unrestricted[rid].outputs[0].token_ids
        for word in words:
            assert not any(tokens[i:i + len(word)] == word for i in range(len(tokens)))
        if params[rid].allowed_token_ids is not None:
            assert set(tokens) <= set(allowed)
