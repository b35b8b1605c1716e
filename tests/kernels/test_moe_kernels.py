"""A mixture-of-experts layer's native kernels against the torch ops they replace.

cpu_ops.moe_combine (the weighted expert outputs added up per token): ``(y * w).to(dtype)``
and one ``index_add_`` per expert in ascending order onto zeros, bit for bit in float32
and bf16, with float32 and bf16 routing weights, tokens with fewer rows (another rank's
experts), products and sums that round either way, and the signs of zeros.

cpu_ops.moe_route (the top-k of a softmax, or of sigmoid scores steered by a selection bias):
models/moe.py's ``route`` (torch's softmax or sigmoid and topk): the same experts wherever no
two scores tie (in the same order where route sorts them), ties to the lower expert, the
weights within float32 rounding of torch's (its exp is not ours), each token's result its
own whatever the batch.

cpu_ops.router_logits (DeepSeek's float32 router on bf16 rows): within float32 rounding of the
float64 products, a row's logits its own whatever the batch and the threads."""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels import cpu_ops
from kvloom.model_families import MoEConfig
from kvloom.models.moe import route

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler to build cpu_ops.cpp")


def same_bits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    integer = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    return torch.equal(got.view(integer), expected.view(integer))


def torch_combine(y: torch.Tensor, weights: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """The reference: each token's rows in pairs' order, one rounded product and one rounded
    add each, as torch computes them (an index_add_ of one row per token at a time)."""
    out = torch.zeros(pairs.shape[0], y.shape[1], dtype=y.dtype)
    for r in range(pairs.shape[1]):
        tokens = (pairs[:, r] >= 0).nonzero().view(-1)
        rows = pairs[tokens, r]
        out.index_add_(0, tokens, (y[rows] * weights[rows].unsqueeze(-1)).to(y.dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "k", "n"), [(1, 2, 7), (5, 8, 16), (40, 2, 1000), (300, 8, 96)])
def test_every_token_is_torchs_sum(dtype: torch.dtype, weight_dtype: torch.dtype, tokens: int, k: int,
                                   n: int) -> None:
    generator = torch.Generator().manual_seed(tokens * k + n)
    rows = tokens * k
    magnitudes = torch.exp2(torch.randint(-8, 8, (rows, n), generator=generator).float())
    y = (torch.randn(rows, n, generator=generator) * magnitudes).to(dtype)
    y.view(-1)[:4] = torch.tensor([0.0, -0.0, -0.0, 0.0], dtype=dtype)  # zero products of either sign
    weights = torch.rand(rows, generator=generator).to(weight_dtype)
    pairs = torch.randperm(rows, generator=generator).view(tokens, k)
    pairs[::3, -1] = -1  # every third token lacks its last row (another rank's expert)
    got = cpu_ops.moe_combine(y, weights.float(), pairs)
    assert same_bits(got, torch_combine(y, weights, pairs))


def test_a_token_without_rows_is_zero() -> None:
    y = torch.randn(2, 8).bfloat16()
    out = cpu_ops.moe_combine(y, torch.ones(2), torch.tensor([[-1, -1], [1, 0]]))
    assert same_bits(out[0], torch.zeros(8, dtype=torch.bfloat16))
    assert same_bits(out[1], torch_combine(y, torch.ones(2), torch.tensor([[1, 0]]))[0])


@pytest.mark.parametrize(("experts", "top_k", "norm", "scaling"), [(8, 2, True, 1.0), (64, 8, False, 1.0),
                                                                   (128, 8, True, 2.5), (6, 6, False, 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_is_torchs_softmax_top_k(experts: int, top_k: int, norm: bool, scaling: float,
                                         dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(experts + top_k)
    logits = (torch.randn(300, experts, generator=generator) * 2).to(dtype)
    weights, chosen = cpu_ops.moe_route(logits, top_k, norm, scaling)
    config = MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=4, sparse_layers=(0,),
                       norm_topk_prob=norm, routed_scaling_factor=scaling)
    expected_weights, expected = route(logits, config)
    scores = logits.float()
    # A tie among the scores that decide a token's choice (the k-th and the next) is broken by
    # torch as it likes; kvloom takes the lower expert. Tokens with any tie are checked apart.
    ranked = scores.sort(dim=1, descending=True).values
    tied = (ranked[:, 1:] == ranked[:, :-1]).any(dim=1)
    assert torch.equal(chosen[~tied], expected[~tied])
    # a few ulps: exp and the sums differ
    torch.testing.assert_close(weights[~tied], expected_weights[~tied], rtol=2e-6, atol=1e-9)
    for token in tied.nonzero().view(-1).tolist():
        picked = chosen[token].tolist()
        values = scores[token, picked]
        assert values.tolist() == sorted(values.tolist(), reverse=True)  # descending
        assert values[-1] >= scores[token].topk(top_k).values[-1]  # the top k scores
        for j in range(top_k - 1):  # among equals, the lower expert first
            assert values[j] > values[j + 1] or picked[j] < picked[j + 1]
    # A token's result is its own.
    alone = cpu_ops.moe_route(logits[7:8], top_k, norm, scaling)
    assert torch.equal(alone[0], weights[7:8]) and torch.equal(alone[1], chosen[7:8])


def test_rounded_routing_weights_are_bf16_values() -> None:
    logits = torch.randn(20, 8)
    weights, _ = cpu_ops.moe_route(logits, 2, True, round_to_bf16=True)
    unrounded, _ = cpu_ops.moe_route(logits, 2, True)
    assert torch.equal(weights, unrounded.bfloat16().float())


@pytest.mark.parametrize(("experts", "top_k", "method", "norm"), [(32, 4, "noaux_tc", True), (16, 2, "greedy", False),
                                                                  (8, 3, "noaux_tc", False)])
def test_sigmoid_routing_is_torchs(experts: int, top_k: int, method: str, norm: bool) -> None:
    """LFM2-MoE's rule (and DeepSeek-V3's in one group): sigmoid scores, the top k of score +
    selection bias (noaux_tc), weighted by the scores alone, renormalised with route()'s guard."""
    generator = torch.Generator().manual_seed(experts)
    logits = (torch.randn(300, experts, generator=generator) * 2).bfloat16()
    bias = torch.randn(experts, generator=generator) * 0.1 if method == "noaux_tc" else None
    config = MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=4, sparse_layers=(0,), scoring="sigmoid",
                       topk_method=method, norm_topk_prob=norm, score_correction_bias=bias is not None,
                       norm_topk_eps=1e-6)
    weights, chosen = cpu_ops.moe_route(logits, top_k, norm, sigmoid=True, bias=bias, eps=1e-6)
    expected_weights, expected = route(logits, config, bias)
    choice = logits.float().sigmoid() + (0 if bias is None else bias)
    assert_same_choices((weights, chosen), (expected_weights, expected), tied_rows(choice), rtol=2e-6)


def tied_rows(values: torch.Tensor) -> torch.Tensor:
    """[tokens] bool: the rows of ``values`` [tokens, n] where two values are equal (a choice
    among them is the implementation's)."""
    ranked = values.sort(dim=1, descending=True).values
    return (ranked[:, 1:] == ranked[:, :-1]).any(dim=1)


def assert_same_choices(ours: tuple[torch.Tensor, torch.Tensor], theirs: tuple[torch.Tensor, torch.Tensor],
                        tied: torch.Tensor, rtol: float) -> None:
    """kvloom's (weights, experts) against route()'s wherever no choice ties: the same experts as
    sets (route() leaves them unsorted), each one's weight within ``rtol``; most rows held."""
    (weights, chosen), (expected_weights, expected) = ours, theirs
    mine, order = chosen.sort(dim=1)
    others, their_order = expected.sort(dim=1)
    assert torch.equal(mine[~tied], others[~tied])
    torch.testing.assert_close(weights.gather(1, order)[~tied], expected_weights.gather(1, their_order)[~tied],
                               rtol=rtol, atol=1e-9)
    assert int((~tied).sum()) > 200  # most tokens held to torch's choice


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_shared_experts_gate_is_torchs_sigmoid_times_x(dtype: torch.dtype) -> None:
    """Qwen2-MoE's ``sigmoid(gate) * shared``: the sigmoid rounded to the dtype, then the
    product rounded; to within an ulp of torch's sigmoid (its exp is not ours): in bf16 nearly
    always its bits."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(200, 96, generator=generator).to(dtype)
    gate = (torch.randn(200, 1, generator=generator) * 4).to(dtype)
    expected = torch.sigmoid(gate) * x
    got = x.clone()
    cpu_ops.sigmoid_gate_(got, gate)
    if dtype == torch.bfloat16:
        assert float((got != expected).float().mean()) < 0.01
    torch.testing.assert_close(got, expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=0.0)


@pytest.mark.parametrize(("tokens", "experts", "n"), [(1, 64, 2048), (7, 9, 100), (33, 6, 15), (4, 256, 448)])
def test_router_logits_are_float32_dot_products_of_each_row_alone(tokens: int, experts: int, n: int) -> None:
    """DeepSeek's float32 router on a bf16 model (kvloom::router_logits): each logit within
    float32 rounding of the float64 product (a bound of n ulps of the products' absolute sum),
    and a row's logits the same bits alone, in any batch and on one thread."""
    generator = torch.Generator().manual_seed(tokens * 1000 + experts)
    x = torch.randn(tokens, n, generator=generator).bfloat16()
    weight = torch.randn(experts, n, generator=generator) / n ** 0.5
    got = cpu_ops.router_logits(x, weight)
    exact = x.double() @ weight.double().T
    bound = n * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.double().abs().T)
    assert got.dtype == torch.float32 and bool(((got.double() - exact).abs() <= bound).all())
    for row in range(tokens):
        assert same_bits(cpu_ops.router_logits(x[row:row + 1], weight), got[row:row + 1]), row
    batched = cpu_ops.router_logits(torch.cat((x.flip(0), x)), weight)[tokens:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = cpu_ops.router_logits(x, weight)
    finally:
        torch.set_num_threads(threads)
    assert same_bits(batched, got) and same_bits(alone, got)


@pytest.mark.parametrize(("experts", "top_k", "method", "groups", "chosen_groups"),
                         [(16, 4, "noaux_tc", 4, 2), (64, 6, "group_limited_greedy", 8, 3), (12, 2, "noaux_tc", 6, 1),
                          (8, 3, "group_limited_greedy", 2, 2)])
def test_group_limited_routing_is_torchs(experts: int, top_k: int, method: str, groups: int,
                                         chosen_groups: int) -> None:
    """DeepSeek's group-limited choice: V2's group_limited_greedy (a softmax, groups ranked by their
    best score) and V3's noaux_tc (sigmoid scores plus the selection bias, groups ranked by their best
    two), held to route()'s torch ops: the same experts wherever no two scores or group scores tie,
    each one's weight within float32 rounding; a token's result its own."""
    generator = torch.Generator().manual_seed(experts + groups)
    logits = torch.randn(300, experts, generator=generator) * 2  # float32, as DeepSeek's router gives them
    sigmoid = method == "noaux_tc"
    bias = torch.randn(experts, generator=generator) * 0.1 if sigmoid else None
    config = MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=4, sparse_layers=(0,),
                       scoring="sigmoid" if sigmoid else "softmax", topk_method=method, norm_topk_prob=sigmoid,
                       score_correction_bias=sigmoid, norm_topk_eps=1e-6, num_groups=groups,
                       topk_groups=chosen_groups, routed_scaling_factor=2.5, router_float32=True)
    rule = "top2_sum" if sigmoid else "best"
    weights, chosen = cpu_ops.moe_route(logits, top_k, sigmoid, 2.5, sigmoid=sigmoid, bias=bias,
                                        eps=1e-6 if sigmoid else 0.0, groups=(groups, chosen_groups, rule))
    expected_weights, expected = route(logits, config, bias)
    scores = logits.float().sigmoid() if sigmoid else torch.softmax(logits.float(), dim=-1)
    choice = (scores + bias if bias is not None else scores).view(300, groups, -1)
    best = choice.sort(dim=2, descending=True).values
    group_scores = best[..., 0] + best[..., 1] if sigmoid else best[..., 0]
    assert_same_choices((weights, chosen), (expected_weights, expected),
                        tied_rows(choice.flatten(1)) | tied_rows(group_scores), rtol=4e-6)
    assert all(len(set((row // (experts // groups)).tolist())) <= chosen_groups for row in chosen)  # within them
    alone, alone_experts = cpu_ops.moe_route(logits[7:8], top_k, sigmoid, 2.5, sigmoid=sigmoid, bias=bias,
                                             eps=1e-6 if sigmoid else 0.0, groups=(groups, chosen_groups, rule))
    assert torch.equal(alone, weights[7:8]) and torch.equal(alone_experts, chosen[7:8])
