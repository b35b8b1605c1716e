"""Exactness in bf16: a request's tokens do not depend on what else the engine does.

The same eight requests (four greedy, four sampled with fixed seeds; some share a
prefix) are run alone, each in a fresh engine (the reference), and then under every
condition that changes the shape of the steps they ride in: batched with 15 random
others, a 32-token budget that chunks every prefill, with prefix-cache hits and with
the cache off, preempted in a pool too small, and in another order of arrival. Every
condition must give the reference's tokens exactly, on tiny bf16 models (head_dim 64:
the paired attention layout; head_dim 16: the token-major one) and on the default
model in bf16.

With ``matmul="onednn"`` this fails (oneDNN's rounding changes with the number of rows
in a step: docs/benchmarks.md); the default ``invariant`` GEMM is what makes it hold.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from helpers_engine import run_arrivals, token_ids
from helpers_models import write_tiny_hf_model

from kvloom import SamplingParams
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine

Request = tuple[str, list[int], SamplingParams]

# name -> (vocab range for random prompts, max new tokens of the targets, longest prompt of the others)
MODELS = {
    "tiny": ((3, 512), 24, 90),
    "tiny-head-dim-16": ((3, 512), 24, 90),  # a token-major cache: the other attention path
    "default": ((200, 20000), 16, 45),  # the real model's tokens cost ~25x a tiny one's: fewer of them
}


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tiny = write_tiny_hf_model(tmp_path_factory.mktemp("tiny-bf16"), arch="llama", hidden_size=256,
                               intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                               num_hidden_layers=2)
    small_heads = write_tiny_hf_model(tmp_path_factory.mktemp("tiny-bf16-hd16"), arch="llama")
    return {"tiny": str(tiny), "tiny-head-dim-16": str(small_heads), "default": "smollm2-135m-instruct"}


def make_requests(model: str) -> tuple[list[Request], list[Request]]:
    """The eight targets and fifteen random others."""
    (low, high), max_tokens, longest_other = MODELS[model]
    rng = random.Random(7)
    shared = [rng.randrange(low, high) for _ in range(40)]  # 2.5 blocks of 16: hits end mid-block
    targets: list[Request] = []
    for i in range(8):
        tail = [rng.randrange(low, high) for _ in range(rng.choice([1, 9, 23, 50]))]
        prompt = shared + tail if i % 2 == 0 else tail + shared[:rng.randrange(5, 40)]
        params = (SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True) if i < 4
                  else SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, seed=100 + i,
                                      ignore_eos=True))
        targets.append((f"t{i}", prompt, params))
    others = [(f"o{i}", [rng.randrange(low, high) for _ in range(rng.randrange(1, longest_other))],
               SamplingParams(max_tokens=rng.randrange(4, 40), temperature=rng.choice([0.0, 1.0]),
                              ignore_eos=True))
              for i in range(15)]
    return targets, others


def run(engine: LLMEngine, arrivals: dict[int, list[Request]]) -> dict[str, list[int]]:
    return token_ids(run_arrivals(engine, arrivals))


def all_at_once(requests: list[Request]) -> dict[int, list[Request]]:
    return {0: list(requests)}


# Each condition: engine arguments and the arrivals of targets + others.
CONDITIONS: dict[str, tuple[dict, Callable[[list[Request], list[Request]], dict[int, list[Request]]]]] = {
    "batched with 15 others": ({}, lambda t, o: all_at_once(o[:8] + t + o[8:])),
    "32-token chunks": ({"max_num_batched_tokens": 32, "long_prefill_threshold": 32},
                        lambda t, o: all_at_once(t + o)),
    "prefix cache off": ({"enable_prefix_caching": False}, lambda t, o: all_at_once(o + t)),
    "prefix cache hits": ({}, lambda t, o: {0: o[:4] + t[:1], 6: t[1:] + o[4:]}),
    "preempted in a small pool": ({"num_blocks": 40}, lambda t, o: all_at_once(t + o)),
    "reversed, staggered arrival": ({}, lambda t, o: {3 * i: [r] for i, r in enumerate(reversed(t + o))}),
}


@pytest.fixture(scope="module", params=list(MODELS))
def matrix_setup(request, model_paths):
    model = request.param
    targets, others = make_requests(model)

    def engine(**kwargs) -> LLMEngine:
        args = dict(dtype="bfloat16", block_size=16, num_blocks=512)
        args.update(kwargs)
        return LLMEngine(EngineConfig.from_kwargs(model_paths[model], **args))

    # Each target alone: one at a time in one engine that keeps nothing between them (no
    # prefix cache, every block free again; a fresh engine each cost ~1 s on the default model).
    alone: dict[str, list[int]] = {}
    solo = engine(enable_prefix_caching=False)
    for target in targets:
        alone.update(run(solo, all_at_once([target])))
        assert solo.kv_manager.num_available_blocks == solo.num_blocks
    return engine, targets, others, alone


@pytest.mark.parametrize("condition", list(CONDITIONS))
def test_tokens_equal_the_request_run_alone(matrix_setup, condition: str) -> None:
    engine_factory, targets, others, alone = matrix_setup
    engine_args, arrivals = CONDITIONS[condition]
    engine = engine_factory(**engine_args)
    results = run(engine, arrivals(targets, others))
    differing = [rid for rid, _, _ in targets if results[rid] != alone[rid]]
    assert not differing, f"{condition}: {differing} differ from the same requests run alone"
    if condition == "preempted in a small pool":
        assert engine.scheduler.num_preemptions > 0
    if condition == "prefix cache hits":
        assert engine.scheduler.num_cached_prompt_tokens > 0
    assert engine.kv_manager.num_available_blocks == engine.num_blocks
