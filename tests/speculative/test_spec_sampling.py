"""Speculative decoding with sampled requests: the output distribution is exactly the
target's, whatever the drafts.

The reference is computed, not sampled: the exact probability of every sequence of
the first three output tokens under top-k sampling, from Hugging Face transformers'
run of the same tiny checkpoint. Each configuration draws a fixed set of seeds (so
the test is deterministic), and a chi-square goodness-of-fit test compares the
counts with those probabilities. Token 1 comes from the prefill; tokens 2 and 3 from
verifying one draft (accepted: token 3 is the bonus; rejected: token 2 is resampled).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from scipy.stats import chisquare

from kvloom import SamplingParams
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.request import Request

PROMPT = [17, 230, 45, 301, 17, 230, 45, 301, 17, 230, 45]  # repeats: prompt lookup has matches
TOP_K = 2
NUM_TOKENS = 3
NUM_SEEDS = 1200


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def next_distribution(hf_model, tokens: Sequence[int]) -> torch.Tensor:
    """The target's top-k sampling distribution after ``tokens`` (float64)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([list(tokens)])).logits[0, -1].double()
    kept = logits.topk(TOP_K)
    probs = torch.zeros_like(logits)
    probs[kept.indices] = kept.values.softmax(-1)
    return probs


def exact_sequences(hf_model) -> dict[tuple[int, ...], float]:
    """P(first NUM_TOKENS output tokens) for every sequence of non-zero probability."""
    sequences = {(): 1.0}
    for _ in range(NUM_TOKENS):
        grown = {}
        for prefix, mass in sequences.items():
            probs = next_distribution(hf_model, PROMPT + list(prefix))
            for token in probs.nonzero().flatten().tolist():
                grown[prefix + (token,)] = mass * probs[token].item()
        sequences = grown
    return sequences


class RankProposer:
    """Drafts the target's rank-``rank`` next token (1: its argmax, a good draft; a
    larger rank: mostly or always rejected), computed with the reference model."""

    name = "rank"
    draft_cost = 0.0

    def __init__(self, hf_model, rank: int) -> None:
        self.hf_model = hf_model
        self.rank = rank

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        drafts = []
        for request, count in zip(requests, num_tokens, strict=True):
            tokens = list(request.all_token_ids)
            guess = []
            for _ in range(count):
                with torch.no_grad():
                    logits = self.hf_model(torch.tensor([tokens])).logits[0, -1]
                guess.append(int(logits.argsort(descending=True)[self.rank - 1]))
                tokens.append(guess[-1])
            drafts.append(guess)
        return drafts

    def release(self, request_id: str) -> None:
        pass

    def check_integrity(self) -> None:
        pass


def sample(engine: LLMEngine, seeds: Sequence[int]) -> dict[int, tuple[int, ...]]:
    for seed in seeds:
        engine.add_request(PROMPT, SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, top_k=TOP_K,
                                                  seed=seed, ignore_eos=True), request_id=str(seed))
    drawn = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                drawn[int(output.request_id)] = tuple(output.outputs[0].token_ids)
    engine.check_integrity()
    return drawn


def make_engine(tiny_llama, speculative: dict | None) -> LLMEngine:
    # Speculation on up to 64 running requests (the step rule would stop it at 32), with
    # every draft offered (the acceptance bar would stop most at this batch size).
    config = None if speculative is None else {**speculative, "max_batched_tokens": 512, "adaptive": False}
    return LLMEngine(EngineConfig.from_kwargs(str(tiny_llama), dtype="float32", num_blocks=1024,
                                              max_num_seqs=48, speculative_config=config))


@pytest.mark.parametrize("drafts", ["off", "good", "bad", "impossible"])
def test_distribution_of_the_first_tokens_is_the_targets(tiny_llama, hf_model, drafts) -> None:
    expected = exact_sequences(hf_model)
    # Good: the target as its own (greedy) draft model. Bad: its second choice, accepted
    # only with that token's probability. Impossible: a token top-k never samples.
    speculative = None if drafts == "off" else \
        {"method": "draft", "model": str(tiny_llama), "num_speculative_tokens": 1}
    engine = make_engine(tiny_llama, speculative)
    if drafts in ("bad", "impossible"):
        engine.proposer = RankProposer(hf_model, {"bad": 2, "impossible": 50}[drafts])
    drawn = sample(engine, range(NUM_SEEDS))
    counts = Counter(drawn.values())
    assert set(counts) <= set(expected), "a sequence the target cannot produce was drawn"
    keys = sorted(expected)
    observed = [counts.get(key, 0) for key in keys]
    result = chisquare(observed, [NUM_SEEDS * expected[key] for key in keys])
    assert result.pvalue > 1e-3, (drafts, result, dict(zip(keys, observed, strict=True)), expected)
    stats = engine.stats()
    if drafts != "off":
        assert stats.num_draft_tokens >= NUM_SEEDS // 2  # the drafts were really verified
    if drafts == "impossible":
        assert stats.num_accepted_tokens == 0
    if drafts == "good":
        assert stats.num_accepted_tokens > stats.num_draft_tokens // 3


def test_a_seeded_request_gives_speculation_offs_tokens_whatever_the_batch(tiny_llama) -> None:
    """Each output token takes the uniform of its position from the request's generator,
    however many drafts its step verified: in bf16 (row-invariant kernels) a seeded
    request's tokens are those of speculation off, alone or in any batch."""
    def engine(speculative: dict | None) -> LLMEngine:
        return LLMEngine(EngineConfig.from_kwargs(str(tiny_llama), num_blocks=512, speculative_config=speculative))

    def draw(engine: LLMEngine, seeds: Sequence[int]) -> dict[int, list[int]]:
        for seed in seeds:
            engine.add_request(PROMPT * 2, SamplingParams(max_tokens=24, temperature=0.7, top_k=3, seed=seed,
                                                          ignore_eos=True), request_id=str(seed))
        drawn = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    drawn[int(output.request_id)] = output.outputs[0].token_ids
            engine.check_integrity()
        return drawn

    off = draw(engine(None), range(12))
    for speculative in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
                        {"method": "draft", "model": str(tiny_llama), "num_speculative_tokens": 3,
                         "adaptive": False}):
        batched = engine(speculative)
        assert draw(batched, range(12)) == off
        assert batched.stats().num_accepted_tokens > 0
        assert draw(engine(speculative), [3]) == {3: off[3]}
