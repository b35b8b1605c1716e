"""Sampler tests against hand-computed values and naive per-row reference code.

Distribution checks use a chi-square goodness-of-fit test at p > 1e-4 with a fixed
default generator, so on a given device they are deterministic.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kvloom.kernels import sampling
from kvloom.runner.sampler import Sampler, SamplerOutput, apply_penalties, native_sampling, sample_rows_native
from kvloom.runner.sampling_metadata import (
    SamplingMetadata,
    SamplingRequestState,
    generator_for_seed,
)
from kvloom.sampling_params import SamplingParams, tokenize_bad_words
from kvloom.structured.constraint import StructuredOutputsParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def make_row(
    device: torch.device,
    prompt: tuple[int, ...] = (),
    output: tuple[int, ...] = (),
    eos: tuple[int, ...] = (),
    **params: object,
) -> SamplingRequestState:
    sampling_params = SamplingParams(**params)  # type: ignore[arg-type]
    seed = sampling_params.seed
    generator = generator_for_seed(seed, device) if seed is not None else None
    return SamplingRequestState(sampling_params, list(prompt), list(output), generator, eos)


def sample(
    rows: list[SamplingRequestState], logits: torch.Tensor, device: torch.device, seed: int = 0
) -> list[int]:
    return sample_full(rows, logits, device, seed).token_ids


def sample_full(
    rows: list[SamplingRequestState], logits: torch.Tensor, device: torch.device, seed: int = 0
) -> SamplerOutput:
    metadata = SamplingMetadata.build(rows, logits.shape[1], device)
    default = generator_for_seed(seed, device)
    return Sampler(default)(logits.to(device), metadata)


def naive_argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


def reference_probs(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> list[float]:
    """Textbook per-row definition of the filtered sampling distribution (float64)."""
    scaled = [x / temperature for x in logits]
    peak = max(scaled)
    weights = [math.exp(x - peak) for x in scaled]
    probs = [w / sum(weights) for w in weights]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = order[:top_k] if top_k > 0 else order
    kept_mass = sum(probs[i] for i in kept)
    nucleus, mass = [], 0.0
    for i in kept:  # most likely first, until the mass reaches top_p
        nucleus.append(i)
        mass += probs[i] / kept_mass
        if mass >= top_p:
            break
    final = [i for i in nucleus if probs[i] >= min_p * probs[order[0]]]
    total = sum(probs[i] for i in final)
    return [probs[i] / total if i in final else 0.0 for i in range(len(probs))]


def chi_square_p_value(counts: Counter[int], probs: list[float]) -> float:
    """Survival function of the chi-square statistic over the tokens with probs > 0."""
    draws = sum(counts.values())
    support = [i for i, p in enumerate(probs) if p > 0]
    stat = sum((counts[i] - draws * probs[i]) ** 2 / (draws * probs[i]) for i in support)
    half_df, x = (len(support) - 1) / 2, stat / 2
    # Regularised lower incomplete gamma P(half_df, x) by its power series.
    term = math.exp(half_df * math.log(x) - x - math.lgamma(half_df + 1)) if x > 0 else 0.0
    total, n = term, 1
    while term > 1e-17 * max(total, 1e-300):
        term *= x / (half_df + n)
        total += term
        n += 1
    return max(0.0, 1.0 - total)


def test_greedy_is_argmax_and_uses_no_randomness(device: torch.device) -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    rows = [make_row(device, temperature=0.0, seed=i if i % 2 else None) for i in range(6)]
    metadata = SamplingMetadata.build(rows, 50, device)
    assert metadata.all_greedy and metadata.temperature is None and metadata.penalties is None
    default = generator_for_seed(0, device)
    before = default.get_state()
    out = Sampler(default)(logits.to(device), metadata)
    assert out.token_ids == [naive_argmax(row) for row in logits.tolist()]
    assert torch.equal(default.get_state(), before)
    for row in rows:
        if row.generator is not None:
            untouched = generator_for_seed(row.params.seed, device)
            assert torch.equal(row.generator.get_state(), untouched.get_state())


def test_greedy_on_bf16_logits_is_the_first_maximum_and_leaves_them_as_they_were(device: torch.device) -> None:
    # The sampler takes any float dtype; ties (common in bf16) go to the lowest token
    # id, as in the float32 argmax of the same values.
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    logits[1, 10] = logits[1, 40] = logits[1].max() + 1
    logits[3, :] = 0.5  # every token tied
    before = logits.clone()
    rows = [make_row(device, temperature=0.0) for _ in range(5)]
    out = sample_full(rows, logits, device)
    assert out.token_ids == [naive_argmax(row) for row in logits.float().tolist()]
    assert out.token_ids[1] == 10 and out.token_ids[3] == 0 and out.logprobs == [None] * 5
    assert torch.equal(logits, before)
    # With logprobs asked for, the same tokens (through the float32 path).
    with_logprobs = [make_row(device, temperature=0.0, logprobs=1) for _ in range(5)]
    assert sample_full(with_logprobs, logits, device).token_ids == out.token_ids


def test_greedy_rows_in_a_mixed_batch_are_argmax(device: torch.device) -> None:
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(2))
    rows = [make_row(device, temperature=0.0 if i % 2 else 1.0, top_k=5) for i in range(8)]
    tokens = sample(rows, logits, device)
    for i in range(1, 8, 2):
        assert tokens[i] == naive_argmax(logits[i].tolist())


def test_seeded_rows_reproducible_across_batch_composition_and_position(
    device: torch.device,
) -> None:
    vocab, steps = 64, 12
    torch_gen = torch.Generator().manual_seed(3)
    target_logits = [torch.randn(vocab, generator=torch_gen) * 0.5 for _ in range(steps)]

    def run(seed: int, batch_size: int, position: int, neighbours: list[dict]) -> list[int]:
        target = make_row(device, seed=seed, temperature=0.9)
        others = [make_row(device, **kw) for kw in neighbours]
        default = generator_for_seed(1234 + batch_size, device)
        sampler, tokens = Sampler(default), []
        for step in range(steps):
            rows = others[:position] + [target] + others[position:]
            logits = torch.randn(batch_size, vocab, generator=torch_gen)
            logits[position] = target_logits[step]
            metadata = SamplingMetadata.build(rows, vocab, device)
            tokens.append(sampler(logits.to(device), metadata).token_ids[position])
        return tokens

    alone = run(7, 1, 0, [])
    neighbours = [{"seed": 99}, {"temperature": 0.0}, {"top_k": 3}, {"top_p": 0.5, "seed": 5}]
    assert run(7, 5, 2, neighbours) == alone
    assert run(7, 5, 4, neighbours) == alone
    assert run(7, 3, 0, [{"min_p": 0.2}, {}]) == alone
    assert run(8, 1, 0, []) != alone


@pytest.mark.parametrize("force_sort", [False, True])
def test_top_k_never_emits_excluded_tokens(device: torch.device, force_sort: bool) -> None:
    # Shuffled positions so the kept set is not a prefix of the vocabulary.
    logits = torch.tensor([0.0, 1.5, -0.5, 1.25, 0.5, 1.45, -1.0, 0.25])
    expected = {3: {1, 5, 3}, 1: {1}, 2: {1, 5}, 0: set(range(8)), 8: set(range(8))}
    rows = [make_row(device, top_k=k) for k in expected for _ in range(2000)]
    if force_sort:  # a top-p row in the batch moves every row onto the sort path
        rows.append(make_row(device, top_p=0.999999))
    tokens = sample(rows, logits.expand(len(rows), -1), device)
    for block, allowed in enumerate(expected.values()):
        assert set(tokens[block * 2000 : (block + 1) * 2000]) == allowed


def test_top_p_keeps_the_smallest_nucleus(device: torch.device) -> None:
    probs = torch.tensor([0.06, 0.3, 0.04, 0.5, 0.1])
    logits = probs.log()
    expected = {0.4: {3}, 0.75: {3, 1}, 0.85: {3, 1, 4}}
    rows = [make_row(device, top_p=p) for p in expected for _ in range(2000)]
    tokens = sample(rows, logits.expand(len(rows), -1), device)
    for block, allowed in enumerate(expected.values()):
        assert set(tokens[block * 2000 : (block + 1) * 2000]) == allowed


def test_min_p_is_relative_to_the_max_prob_after_temperature(device: torch.device) -> None:
    logits = torch.tensor([0.06, 0.3, 0.04, 0.5, 0.1]).log()
    # T=1: threshold 0.1 * 0.5 = 0.05 keeps {0.5, 0.3, 0.1, 0.06}.
    # T=0.5: probs ~ p^2, relative to max: 0.36, 0.04, 0.0144, 0.0064 -> only 0.3 survives.
    cases = [
        ({"min_p": 0.25}, {3, 1}),
        ({"min_p": 0.1}, {3, 1, 4, 0}),
        ({"min_p": 0.1, "temperature": 0.5}, {3, 1}),
    ]
    rows = [make_row(device, **kw) for kw, _ in cases for _ in range(2000)]
    tokens = sample(rows, logits.expand(len(rows), -1), device)
    for block, (_, allowed) in enumerate(cases):
        assert set(tokens[block * 2000 : (block + 1) * 2000]) == allowed


def test_filtered_distributions_match_reference(device: torch.device) -> None:
    logits = [1.0, -0.5, 2.0, 0.0, -3.0, 1.5, -1.0, 0.3]
    configs = [
        {"temperature": 1.0},
        {"temperature": 0.7},
        {"temperature": 0.8, "top_k": 5, "min_p": 0.1},  # keeps 4 tokens
        {"temperature": 1.3, "top_p": 0.8},  # keeps 4
        {"temperature": 1.5, "top_k": 6, "top_p": 0.97, "min_p": 0.03},  # keeps 6
        {"temperature": 0.6, "top_k": 3},  # keeps 3
    ]  # margins checked: moving p by 0.01 or min_p by 0.005 keeps the same sets
    draws = 6000
    # Interleaved, with greedy rows between, so every knob is routed per row.
    rows, owners = [], []
    for _ in range(draws):
        for c, config in enumerate(configs):
            rows.append(make_row(device, **config))
            owners.append(c)
        rows.append(make_row(device, temperature=0.0))
        owners.append(-1)
    batch = torch.tensor(logits).expand(len(rows), -1)
    tokens = sample(rows, batch, device, seed=11)
    for c, config in enumerate(configs):
        expected = reference_probs(
            logits,
            temperature=config["temperature"],
            top_k=config.get("top_k", 0),
            top_p=config.get("top_p", 1.0),
            min_p=config.get("min_p", 0.0),
        )
        counts = Counter(t for t, owner in zip(tokens, owners, strict=False) if owner == c)
        assert all(expected[t] > 0 for t in counts), (config, counts)
        assert chi_square_p_value(counts, expected) > 1e-4, (config, counts, expected)
    assert {t for t, owner in zip(tokens, owners, strict=False) if owner == -1} == {2}


def test_penalties_match_hand_computed_values(device: torch.device) -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    penalised = make_row(
        device,
        prompt=(0, 4),
        output=(1, 1, 2),
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.3,
    )
    plain = make_row(device, prompt=(0, 4), output=(1, 1, 2))
    metadata = SamplingMetadata.build([plain, penalised], 5, device)
    result = apply_penalties(logits.clone().to(device), metadata.penalties).cpu()
    # Repetition on seen {0, 1, 2, 4}: 2/2, -1*2, 0.5/2, 3 (unseen), -2*2.
    # Frequency 0.5 * counts {1: 2, 2: 1}; presence 0.3 on {1, 2}.
    expected = [1.0, -2.0 - 1.0 - 0.3, 0.25 - 0.5 - 0.3, 3.0, -4.0]
    torch.testing.assert_close(result[1], torch.tensor(expected))
    torch.testing.assert_close(result[0], logits[0])  # rows without penalties untouched


def test_penalties_match_naive_reference_on_random_batches(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(4)
    vocab = 40
    rows, reference = [], []
    logits = torch.randn(6, vocab, generator=gen) * 3
    for i in range(6):
        prompt = torch.randint(0, vocab, (2 * i,), generator=gen).tolist()
        output = torch.randint(0, vocab, (3 * i,), generator=gen).tolist()
        knobs = {
            "repetition_penalty": 1.0 + 0.3 * (i % 3),
            "frequency_penalty": -0.4 * (i % 2),
            "presence_penalty": 0.7 if i > 2 else 0.0,
        }
        rows.append(make_row(device, prompt=tuple(prompt), output=tuple(output), **knobs))
        row = logits[i].tolist()
        for t in range(vocab):
            if t in prompt or t in output:
                p = knobs["repetition_penalty"]
                row[t] = row[t] / p if row[t] > 0 else row[t] * p
            row[t] -= knobs["frequency_penalty"] * output.count(t)
            row[t] -= knobs["presence_penalty"] * (t in output)
        reference.append(row)
    metadata = SamplingMetadata.build(rows, vocab, device)
    result = apply_penalties(logits.clone().to(device), metadata.penalties).cpu()
    torch.testing.assert_close(result, torch.tensor(reference))


def test_penalty_changes_the_greedy_choice(device: torch.device) -> None:
    logits = torch.tensor([[1.0, 0.9, -5.0]])
    row = make_row(device, output=(0,), temperature=0.0, presence_penalty=0.5)
    assert sample([row], logits, device) == [1]


def test_min_tokens_blocks_eos_and_stop_token_ids(device: torch.device) -> None:
    eos, stop = 5, 4
    eos_first = torch.tensor([0.0, 0.0, 2.0, 0.0, 3.0, 4.0])  # eos > stop > token 2
    stop_first = torch.tensor([0.0, 0.0, 2.0, 0.0, 4.0, 3.0])

    def greedy(logits: torch.Tensor, output: tuple[int, ...], **kw: object) -> int:
        row = make_row(
            device,
            output=output,
            eos=(eos,),
            temperature=0.0,
            min_tokens=2,
            stop_token_ids=[stop],
            **kw,
        )
        return sample([row], logits.unsqueeze(0), device)[0]

    assert greedy(eos_first, ()) == 2
    assert greedy(eos_first, (1,)) == 2
    assert greedy(eos_first, (1, 1)) == eos  # min_tokens reached: nothing blocked
    assert greedy(stop_first, (1, 1)) == stop
    assert greedy(eos_first, (), ignore_eos=True) == eos  # eos is an ordinary token
    assert greedy(stop_first, (), ignore_eos=True) == eos  # stop ids stay blocked

    random_row = {"eos": (eos, 3), "min_tokens": 3, "stop_token_ids": [stop]}
    rows = [make_row(device, **random_row) for _ in range(2000)]
    tokens = sample(rows, torch.zeros(2000, 6), device)
    assert set(tokens) == {0, 1, 2}


def test_logprobs_are_raw_log_softmax_with_true_top_n(device: torch.device) -> None:
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(5)) * 2
    rows = [
        make_row(device, logprobs=5, temperature=0.7, top_k=10, presence_penalty=1.0, output=(1,)),
        make_row(device),
        make_row(device, logprobs=0, temperature=0.0),
        make_row(device, logprobs=20, temperature=0.0, repetition_penalty=3.0, prompt=(7,)),
    ]
    out = sample_full(rows, logits, device)
    assert out.logprobs[1] is None
    for i, n in [(0, 5), (2, 0), (3, 20)]:
        entry, row = out.logprobs[i], logits[i].double()
        reference = (row - row.exp().sum().log()).tolist()  # log_softmax, float64
        token = out.token_ids[i]
        assert entry is not None and entry.token_id == token
        assert entry.logprob == pytest.approx(reference[token], abs=1e-5)
        assert entry.rank == 1 + sum(v > reference[token] for v in reference)
        best = sorted(range(40), key=lambda t: -reference[t])[:n]
        assert [t for t, _ in entry.top_logprobs] == best
        for t, value in entry.top_logprobs:
            assert value == pytest.approx(reference[t], abs=1e-5)
    assert out.logprobs[2].rank == 1  # greedy without penalties: the argmax


def test_bfloat16_logits_are_upcast_and_inputs_not_modified(device: torch.device) -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(6)).to(device)
    original = logits.clone()
    rows = [
        make_row(device, output=(1,), frequency_penalty=1.0, min_tokens=3, eos=(2,)),
        make_row(device, temperature=0.0, logprobs=2),
        make_row(device, top_p=0.5),
    ]
    sample_full(rows, logits, device)
    assert torch.equal(logits, original)
    out = sample_full(rows, logits.bfloat16(), device)
    assert out.token_ids[1] == naive_argmax(logits.bfloat16().float()[1].tolist())


def test_metadata_skips_unused_stages(device: torch.device) -> None:
    rows = [make_row(device, temperature=0.0), make_row(device, top_p=0.9)]
    metadata = SamplingMetadata.build(rows, 10, device)
    assert not metadata.all_greedy and not metadata.all_random
    assert metadata.top_k is None and metadata.min_p is None and metadata.penalties is None
    assert metadata.blocked_rows is None and metadata.logprob_rows is None
    assert metadata.top_p is not None and metadata.top_p.tolist() == [pytest.approx(0.9)]


def test_invalid_inputs_raise(device: torch.device) -> None:
    seeded = SamplingRequestState(SamplingParams(seed=3), [], [], None, ())
    with pytest.raises(ValueError, match="seed"):
        SamplingMetadata.build([seeded], 10, device)
    metadata = SamplingMetadata.build([make_row(device)], 10, device)
    with pytest.raises(ValueError, match="shape"):
        Sampler(generator_for_seed(0, device))(torch.zeros(1, 11, device=device), metadata)


def test_cpu_one_pass_draw_equals_the_pytorch_inverse_cdf() -> None:
    """csrc/sampling.cpp draws, from the same uniforms, the tokens of the PyTorch chain
    (temperature, softmax, cumsum, searchsorted), skips -inf entries, and takes the first
    / last token with mass at u = 0 / u -> 1."""
    assert native_sampling(), "csrc/sampling.cpp did not build"
    generator = torch.Generator().manual_seed(0)
    rows, vocab = 256, 1003  # a vocabulary that is not a multiple of 16
    logits = torch.randn(rows, vocab, generator=generator) * 3
    logits[::3, ::7] = float("-inf")
    logits[5, :40] = float("-inf")
    logits[6, -1] = 20.0  # enough mass that u just below 1 lands on it
    temperature = torch.rand(rows, 1, generator=generator) + 0.3
    uniforms = torch.rand(rows, generator=generator)
    uniforms[5], uniforms[6] = 0.0, 1.0 - 2.0**-24
    expected = Sampler._inverse_cdf(torch.softmax(logits / temperature, dim=-1), uniforms)
    actual = sample_rows_native(logits, 1.0 / temperature, uniforms)
    assert torch.equal(actual, expected)
    assert actual[5] == 40  # u = 0: the first token with mass
    assert actual[6] == vocab - 1  # u just below 1: the last one
    assert not torch.isinf(logits[torch.arange(rows), actual]).any()


# ---- logit_bias ------------------------------------------------------------------------
def test_logit_bias_plus_100_makes_greedy_pick_the_token(device: torch.device) -> None:
    logits = torch.tensor([[3.0, 1.0, -2.0, 0.5], [3.0, 1.0, -2.0, 0.5], [3.0, 1.0, -2.0, 0.5]])
    rows = [make_row(device, temperature=0.0, logit_bias={2: 100.0}),
            make_row(device, temperature=0.0),  # no bias: the argmax
            make_row(device, temperature=0.0, logit_bias={"0": -100, "3": 0.6})]  # 0.5+0.6 > 1.0
    assert sample(rows, logits, device) == [2, 0, 3]


def test_logit_bias_is_added_after_penalties_and_before_min_tokens(device: torch.device) -> None:
    # Token 0 (logit 2.0) was generated: repetition 2 -> 1.0, then +0.5 -> 1.5 beats token 1's
    # 1.4. Biasing first would give (2.0 + 0.5) / 2 = 1.25 and pick token 1.
    logits = torch.tensor([[2.0, 1.4, 0.0], [0.0, 0.0, 1.0]])
    rows = [make_row(device, output=(0,), temperature=0.0, repetition_penalty=2.0, logit_bias={0: 0.5}),
            # EOS (token 2) is blocked below min_tokens whatever its bias.
            make_row(device, eos=(2,), temperature=0.0, min_tokens=1, logit_bias={2: 100.0, 1: 0.25})]
    assert sample(rows, logits, device) == [0, 1]


def test_logit_bias_leaves_logprobs_raw(device: torch.device) -> None:
    logits = torch.tensor([[1.0, 0.0, -1.0]])
    rows = [make_row(device, temperature=0.0, logprobs=1, logit_bias={2: 50.0})]
    out = sample_full(rows, logits, device)
    assert out.token_ids == [2]
    entry = out.logprobs[0]
    assert entry is not None
    raw = torch.log_softmax(logits[0].double(), dim=-1)
    assert entry.logprob == pytest.approx(raw[2].item(), abs=1e-5) and entry.rank == 3


def test_seeded_biased_draw_equals_the_pytorch_reference_chain(device: torch.device) -> None:
    """Seeded rows draw exactly the token of the reference chain: softmax((logits + bias) / T),
    inverse CDF with the uniform the request's own generator yields."""
    logits = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -0.3])
    bias = {1: 2.5, 2: -1.5, 5: 0.7}
    bias_row = torch.zeros(6)
    for token, value in bias.items():
        bias_row[token] = value
    seeds = list(range(300))
    rows = [make_row(device, seed=s, temperature=0.8, logit_bias=bias) for s in seeds]
    tokens = sample(rows, logits.expand(len(rows), -1), device)
    probs = torch.softmax((logits + bias_row) / 0.8, dim=-1).to(device).unsqueeze(0)  # [1, V]
    for seed, token in zip(seeds, tokens, strict=True):
        uniform = torch.empty(1, device=device).uniform_(generator=generator_for_seed(seed, device))
        assert token == Sampler._inverse_cdf(probs, uniform).item(), seed


def test_logit_bias_distribution_is_softmax_of_biased_logits(device: torch.device) -> None:
    logits = [1.0, -0.5, 2.0, 0.0, -3.0]
    bias = {0: 1.0, 2: -2.0, 4: 3.5}
    biased = [x + bias.get(i, 0.0) for i, x in enumerate(logits)]
    weights = [math.exp(x) for x in biased]  # textbook softmax in float64, temperature 1
    expected = [w / sum(weights) for w in weights]
    rows = [make_row(device, logit_bias=bias) for _ in range(8000)]
    tokens = sample(rows, torch.tensor(logits).expand(len(rows), -1), device, seed=5)
    assert chi_square_p_value(Counter(tokens), expected) > 1e-4


def test_logit_bias_metadata_only_when_used(device: torch.device) -> None:
    plain = SamplingMetadata.build([make_row(device)], 10, device)
    assert plain.bias_rows is None and plain.bias_values is None
    rows = [make_row(device), make_row(device, logit_bias={7: -1.0, 3: 2.0, 12: 5.0})]
    metadata = SamplingMetadata.build(rows, 10, device)
    assert metadata.bias_rows is not None and metadata.bias_token_ids is not None
    assert metadata.bias_rows.tolist() == [1, 1]  # id 12 is outside the logits: skipped
    assert metadata.bias_token_ids.tolist() == [3, 7]
    assert metadata.bias_values is not None and metadata.bias_values.tolist() == [2.0, -1.0]


@pytest.mark.parametrize("bias, match", [
    ({1: 100.5}, "logit_bias must be <= 100"), ({"1": -101}, "logit_bias must be >= -100"),
    ({"a": 1}, "logit_bias keys"), ({-1: 1}, "logit_bias keys"), ({1: "x"}, "logit_bias must be a number"),
    ({1: float("nan")}, "logit_bias must be a finite"), ([1, 2], "logit_bias must be a mapping"),
])
def test_logit_bias_validation_names_the_field(bias: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(logit_bias=bias)  # type: ignore[arg-type]
    assert SamplingParams(logit_bias={"5": 1, 6: -2.5}).logit_bias == {5: 1.0, 6: -2.5}
    assert SamplingParams(logit_bias={}).logit_bias is None


@pytest.mark.skipif(not sampling.available(), reason="sampling.cpp does not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_argmax_takes_the_first_maximum_of_every_row(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(4)
    for rows, vocab in [(1, 1), (3, 15), (4, 17), (7, 49152), (2, 100)]:
        logits = torch.randn(rows, vocab, generator=generator).to(dtype)
        if vocab > 20:
            logits[0, 19] = logits[0, 5] = logits[0].max() + 1  # a tie across lanes
        got = sampling.argmax_rows(logits).tolist()
        assert got == [naive_argmax(row) for row in logits.float().tolist()], (rows, vocab)
    special = torch.full((3, 40), float("-inf"))
    special[1, 21] = special[1, 36] = float("nan")  # torch counts the first NaN as the maximum
    special[2, 39] = 1.0
    assert sampling.argmax_rows(special.to(dtype)).tolist() == [0, 21, 39]
    with pytest.raises(ValueError, match="logits must have at least one column"):
        sampling.argmax_rows(torch.empty(2, 0, dtype=dtype))


# ---- allowed_token_ids and bad words (vLLM's) ----------------------------------------------


def test_allowed_token_ids_greedy_is_the_argmax_over_the_allowed(device: torch.device) -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, 40)
    allowed = [[3, 17, 29], [0], [39, 5, 6, 7]]
    rows = [make_row(device, temperature=0.0, allowed_token_ids=allowed[0]),
            make_row(device, temperature=0.0, allowed_token_ids=allowed[1], logit_bias={1: 100.0}),
            make_row(device, temperature=0.0),  # unrestricted: the plain argmax
            make_row(device, temperature=0.0, allowed_token_ids=allowed[2], logit_bias={6: 50.0})]
    biased = logits.clone()
    biased[1, 1] += 100.0
    biased[3, 6] += 50.0
    expected = [max(allowed[0], key=lambda t: biased[0, t].item()), 0, naive_argmax(logits[2].tolist()),
                max(allowed[2], key=lambda t: biased[3, t].item())]
    assert expected[3] == 6  # the bias applies among the allowed
    assert sample(rows, logits, device) == expected


def test_allowed_token_ids_draws_from_the_renormalised_allowed_softmax(device: torch.device) -> None:
    logits = [1.0, -0.5, 2.0, 0.0, -3.0, 4.0]
    allowed = [0, 1, 4]
    weights = [math.exp(x) if i in allowed else 0.0 for i, x in enumerate(logits)]
    expected = [w / sum(weights) for w in weights]  # float64 textbook softmax over the allowed
    rows = [make_row(device, allowed_token_ids=allowed) for _ in range(8000)]
    tokens = sample(rows, torch.tensor(logits).expand(len(rows), -1), device, seed=11)
    assert set(tokens) <= set(allowed)
    assert chi_square_p_value(Counter(tokens), expected) > 1e-4


def test_bad_words_block_the_token_that_would_complete_them(device: torch.device) -> None:
    # Output so far ends ..., 5, 6. Words [6, 9] and [5, 6, 7] would be completed by 9 and 7,
    # the one-token word [8] is always blocked; [4, 6, 2] is not (its prefix is not the end of
    # the output), nor [1, 2, 3, 4] (longer than the output + 1).
    words = [[6, 9], [5, 6, 7], [8], [4, 6, 2], [1, 2, 3, 4]]
    rows = [make_row(device, output=(1, 5, 6), temperature=0.0, bad_words_token_ids=words),
            make_row(device, output=(), temperature=0.0, bad_words_token_ids=words)]
    metadata = SamplingMetadata.build(rows, 12, device)
    assert metadata.blocked_rows is not None and metadata.blocked_token_ids is not None
    pairs = list(zip(metadata.blocked_rows.tolist(), metadata.blocked_token_ids.tolist(), strict=True))
    assert pairs == [(0, 7), (0, 8), (0, 9), (1, 8)]
    # Greedy then takes the best token that is not blocked.
    logits = torch.tensor([[0.0] * 7 + [5.0, 6.0, 7.0, 4.0, 0.0]] * 2)
    assert sample(rows, logits, device) == [10, 9]


def test_allowed_and_bad_words_metadata_only_when_used(device: torch.device) -> None:
    plain = SamplingMetadata.build([make_row(device)], 10, device)
    assert plain.allowed_rows is None and plain.allowed_mask is None and plain.blocked_rows is None
    rows = [make_row(device), make_row(device, allowed_token_ids=[2, 9, 14])]
    metadata = SamplingMetadata.build(rows, 10, device)
    assert metadata.allowed_rows is not None and metadata.allowed_rows.tolist() == [1]
    assert metadata.allowed_mask is not None  # id 14 is past the logits: left out
    assert metadata.allowed_mask.nonzero().tolist() == [[0, 2], [0, 9]]


@pytest.mark.parametrize("params, match", [
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids must be >= 0"),
    ({"allowed_token_ids": "12"}, "allowed_token_ids must be a list"),
    ({"allowed_token_ids": [1.5]}, "allowed_token_ids must be an integer"),
    ({"bad_words": "word"}, "bad_words must be a list of strings"),
    ({"bad_words": ["ok", " "]}, "bad_words must be non-empty strings"),
    ({"bad_words": ["w"] * 65}, "bad_words may hold at most 64"),
    ({"bad_words_token_ids": [[1], []]}, "must not hold an empty sequence"),
    ({"bad_words_token_ids": [[1, "2"]]}, "bad_words_token_ids must be an integer"),
    ({"allowed_token_ids": [5], "structured_outputs": StructuredOutputsParams(choice=["yes", "no"])},
     "allowed_token_ids cannot be combined with structured output"),
])
def test_allowed_and_bad_words_validation_names_the_field(params: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**params)  # type: ignore[arg-type]


def test_bad_words_take_vllms_two_forms() -> None:
    # A word and, where a space before it gives another first token and as many tokens,
    # its mid-text form; a form that splits otherwise is left out.
    vocab = {"cat": [7], " cat": [8], "dog": [3, 4], " dog": [9], "bird": [5], " bird": [5]}
    assert tokenize_bad_words(["cat", " dog", "bird"], vocab.__getitem__) == [[7], [8], [3, 4], [5]]
