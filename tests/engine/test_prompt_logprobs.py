"""Prompt logprobs against transformers: every prompt token's logprob under the tokens
before it, whole or in chunks, with a prefix-cache hit available and after preemption."""

from __future__ import annotations

import pytest
import torch

from kvloom import SamplingParams
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine

PROMPT = [3, 17, 99, 250, 41, 7, 7, 300, 12, 88, 151, 9, 64, 480, 2, 33, 71, 5, 210, 19, 402, 6]
SHARED = PROMPT[:16]  # a cached prefix a plain request leaves behind
TOP = 3


def reference_for(tiny_llama, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of ``prompt``, [P, V]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def reference(tiny_llama) -> torch.Tensor:
    return reference_for(tiny_llama, PROMPT)


def run(tiny_llama, requests, **engine_kwargs) -> dict:
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_llama), dtype="float32", block_size=4,
                                                **{"num_blocks": 64, **engine_kwargs}))
    finals = {}
    for request_id, prompt, params in requests:
        engine.add_request(prompt, params, request_id=request_id)
        while engine.has_unfinished_requests():  # one after the other: the first caches its prefix
            for output in engine.step():
                if output.finished:
                    finals[output.request_id] = output
            engine.check_integrity()
    assert engine.kv_manager.num_available_blocks == engine.num_blocks
    return finals


@pytest.mark.parametrize("engine_kwargs", [
    {},  # the whole prompt in one step
    {"max_num_batched_tokens": 5, "long_prefill_threshold": 5},  # five chunks
    {"enable_prefix_caching": True},  # a 16-token hit is cached, and must not be used
], ids=["whole", "chunked", "prefix cache"])
def test_prompt_logprobs_match_transformers(tiny_llama, reference, engine_kwargs) -> None:
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
    finals = run(tiny_llama, [("warm", SHARED + [1], SamplingParams(max_tokens=1)), ("r", PROMPT, params)],
                 **engine_kwargs)
    prompt_logprobs = finals["r"].prompt_logprobs
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(PROMPT) and prompt_logprobs[0] is None
    for position in range(1, len(PROMPT)):
        entry = prompt_logprobs[position]
        expected = reference[position - 1]
        token = PROMPT[position]
        assert list(entry)[0] == token  # the prompt's own token first, as vLLM orders it
        assert entry[token].logprob == pytest.approx(expected[token].item(), abs=1e-4)
        assert entry[token].rank == int((expected > expected[token]).sum()) + 1
        top_ids = expected.topk(TOP).indices.tolist()
        assert set(top_ids) <= set(entry) and len(entry) in (TOP, TOP + 1)
        for token_id in top_ids:
            assert entry[token_id].logprob == pytest.approx(expected[token_id].item(), abs=1e-4)
    assert finals["warm"].prompt_logprobs is None  # not asked for


def test_a_preempted_request_keeps_each_position_once(tiny_llama, reference) -> None:
    """A pool too small for two long requests: one is preempted and recomputes its
    prompt; its prompt logprobs are still one per position, equal to transformers'."""
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_llama), dtype="float32", block_size=4, num_blocks=14,
                                                max_num_batched_tokens=8, long_prefill_threshold=8))
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    engine.add_request(PROMPT, params, request_id="a")
    engine.add_request(PROMPT[::-1], params, request_id="b")
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    preempted = [rid for rid, output in finals.items() if output.metrics.preempted_steps]
    assert preempted
    for request_id, prompt in (("a", PROMPT), ("b", PROMPT[::-1])):
        expected = reference if request_id == "a" else reference_for(tiny_llama, prompt)
        logprobs = finals[request_id].prompt_logprobs
        assert len(logprobs) == len(prompt)
        for position in range(1, len(prompt)):
            token = prompt[position]
            assert logprobs[position][token].logprob == pytest.approx(expected[position - 1][token].item(),
                                                                      abs=1e-4)


def test_prompt_logprobs_are_validated() -> None:
    # The ceiling is the engine's max_logprobs (test_max_logprobs.py), not SamplingParams'.
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.parametrize("start", [17, 18, 20])
def test_logprobs_from_a_start_take_the_cached_prefix(tiny_llama, reference, start: int) -> None:
    """``prompt_logprobs_start``: the 16 cached tokens are a hit (capped so that position
    start - 1, which scores token start, is computed), positions before start are None
    and the rest equal transformers'."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, prompt_logprobs_start=start)
    finals = run(tiny_llama, [("warm", SHARED + [1], SamplingParams(max_tokens=1)), ("r", PROMPT, params)])
    assert finals["r"].num_cached_tokens == 16
    prompt_logprobs = finals["r"].prompt_logprobs
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(PROMPT)
    assert all(prompt_logprobs[p] is None for p in range(start))
    for position in range(start, len(PROMPT)):
        token = PROMPT[position]
        assert prompt_logprobs[position][token].logprob == pytest.approx(reference[position - 1][token].item(),
                                                                         abs=1e-4)


def test_a_start_inside_the_cached_prefix_caps_the_hit(tiny_llama, reference) -> None:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, prompt_logprobs_start=9)
    finals = run(tiny_llama, [("warm", SHARED + [1], SamplingParams(max_tokens=1)), ("r", PROMPT, params)])
    assert finals["r"].num_cached_tokens == 8  # block-aligned, at most start - 1 = 8 tokens
    entry = finals["r"].prompt_logprobs[9]
    assert entry[PROMPT[9]].logprob == pytest.approx(reference[8][PROMPT[9]].item(), abs=1e-4)
