"""The thinking budget (``SamplingParams.thinking_budget``, vLLM's ``thinking_token_budget``):
an output that has generated ``tokens`` tokens without its reasoning's end marker takes the
marker next and goes on. Held to transformers' greedy decoding of the tiny model with the
marker put in by hand where the budget runs out, in one batch, with n-gram speculation
(its drafts verified against the forced token) and with overlap scheduling; a seeded
sample keeps its tokens before the budget and takes the marker there."""

from __future__ import annotations

import random

import pytest
import torch
from helpers_models import hf_greedy_tokens

from kvloom import LLM, SamplingParams, ThinkingBudget
from kvloom.engine.admission import RequestRejected

RNG = random.Random(11)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(RNG.randrange(5, 30))] for _ in range(4)]
END = 7  # the end marker's id here: any token of the vocabulary
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()


def expected(hf_model, prompt: list[int], budget: int) -> list[int]:
    """Greedy up to the budget; the marker there, unless it came before; then greedy on."""
    head = hf_greedy_tokens(hf_model, prompt, budget)
    if END in head:
        return hf_greedy_tokens(hf_model, prompt, MAX_TOKENS)
    return head + [END] + hf_greedy_tokens(hf_model, prompt + head + [END], MAX_TOKENS - budget - 1)


def greedy(budget: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                          thinking_budget=ThinkingBudget(budget, END))


@pytest.mark.parametrize("engine", ["plain", "ngram speculation", "overlap"])
def test_greedy_outputs_take_the_marker_where_the_budget_runs_out(tiny_llama, hf_model, engine: str) -> None:
    kwargs = {"plain": {}, "ngram speculation": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                                        "prompt_lookup_min": 1}},
              "overlap": {"overlap_scheduling": "on"}}[engine]
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=128, block_size=8, **kwargs)
    budgets = [0, 3, 5, MAX_TOKENS - 1]
    # A prompt that repeats itself, so that n-gram drafts are proposed across the budget.
    prompts = [*PROMPTS, PROMPTS[0] * 3]
    cases = [(prompt, budget) for prompt in prompts for budget in budgets]
    outputs = llm.generate([prompt for prompt, _ in cases], [greedy(budget) for _, budget in cases])
    for (prompt, budget), output in zip(cases, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == expected(hf_model, prompt, budget), (prompt, budget)
    assert llm.engine.kv_manager.num_available_blocks == llm.engine.num_blocks


def test_an_output_that_ends_its_reasoning_itself_is_not_forced(tiny_llama, hf_model) -> None:
    plain = hf_greedy_tokens(hf_model, PROMPTS[1], MAX_TOKENS)
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64, block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            thinking_budget=ThinkingBudget(4, plain[1]))  # its own second token as the marker
    assert list(llm.generate([PROMPTS[1]], params)[0].outputs[0].token_ids) == plain


def test_a_seeded_sample_keeps_its_tokens_before_the_budget_and_takes_the_marker(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64, block_size=8)
    free = SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    for budget in (0, 2, 6):
        capped = SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True,
                                thinking_budget=ThinkingBudget(budget, END))
        unforced, forced = (list(o.outputs[0].token_ids) for o in llm.generate([PROMPTS[2]] * 2, [free, capped]))
        assert END not in unforced[:budget]  # else the budget would not bind here
        assert forced[:budget + 1] == [*unforced[:budget], END]


def test_a_budget_that_names_no_token_is_refused(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64, block_size=8)
    with pytest.raises(RequestRejected, match=r"thinking_budget.end_token_id must be token ids in \[0, "):
        llm.generate([PROMPTS[0]], SamplingParams(thinking_budget=ThinkingBudget(2, 10**6)))
    with pytest.raises(ValueError, match="thinking_budget.tokens must be"):
        ThinkingBudget(-1, END)
    with pytest.raises(ValueError, match="thinking_budget must be a ThinkingBudget"):
        SamplingParams(thinking_budget=3)  # type: ignore[arg-type]
    assert llm.engine.kv_manager.num_available_blocks == llm.engine.num_blocks
