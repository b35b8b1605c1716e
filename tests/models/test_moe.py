"""The mixture-of-experts FFN (models/moe.py): each family's router and experts against
transformers' own MoE modules on random weights, the grouped experts against the
per-token reference loop, routing edge cases, checkpoint names, and tiny Mixtral and
Qwen2-MoE through the engine (greedy tokens identical to transformers in float32 through
chunked prefill, batching and preemption; bf16 runs)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_models import hf_greedy_with_cache, write_tiny_hf_model

from kvloom import LLM, SamplingParams
from kvloom.config import ModelConfig
from kvloom.model_families import MoEConfig
from kvloom.models.llama import LlamaForCausalLM
from kvloom.models.moe import SparseMoE, experts_grouped, experts_reference, route
from kvloom.models.sharding import TensorSlice, llama_weight_slice, moe_weight_slice, tensor_parallel_problem

HIDDEN = 32
# family -> (HF config class, architecture, transformers module and MoE block class, config overrides)
V2 = "deepseek_v2.modeling_deepseek_v2:DeepseekV2Moe"
BLOCKS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "mixtral.modeling_mixtral:MixtralSparseMoeBlock",
                dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "qwen2_moe.modeling_qwen2_moe:Qwen2MoeSparseMoeBlock",
                  dict(num_experts=8, num_experts_per_tok=4, moe_intermediate_size=16,
                       shared_expert_intermediate_size=40, norm_topk_prob=False)),
    "qwen2_moe-norm": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "qwen2_moe.modeling_qwen2_moe:Qwen2MoeSparseMoeBlock",
                       dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
                            shared_expert_intermediate_size=24, norm_topk_prob=True)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3_moe.modeling_qwen3_moe:Qwen3MoeSparseMoeBlock",
                  dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, norm_topk_prob=True)),
    "deepseek_v2-greedy": ("DeepseekV2Config", "DeepseekV2ForCausalLM", V2,
                           dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
                                n_shared_experts=2, topk_method="greedy")),
    "deepseek_v2-grouped": ("DeepseekV2Config", "DeepseekV2ForCausalLM", V2,
                            dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
                                 n_shared_experts=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                 routed_scaling_factor=16.0)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", "deepseek_v3.modeling_deepseek_v3:DeepseekV3MoE",
                    dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, n_shared_experts=1,
                         n_group=4, topk_group=2, first_k_dense_replace=0, routed_scaling_factor=2.5,
                         kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)),
}


def hf_block(family: str, seed: int = 0) -> tuple[torch.nn.Module, MoEConfig]:
    """transformers' MoE block of ``family`` with random weights (eager experts), and our config."""
    import transformers

    config_class, arch, location, overrides = BLOCKS[family]
    config = getattr(transformers, config_class)(hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2,
                                                 num_attention_heads=4, **overrides)
    config._experts_implementation = "eager"  # the plain loop: our grouped rows are in its order
    module, name = location.split(":")
    torch.manual_seed(seed)
    block = getattr(importlib.import_module(f"transformers.models.{module}"), name)(config).eval()
    with torch.no_grad():
        for tensor in [*block.parameters(), *block.buffers()]:
            tensor.normal_(0.0, 0.3)
    moe = MoEConfig.from_hf({**config.to_dict(), "architectures": [arch]})
    assert moe is not None
    return block, moe


def ours_from(block: torch.nn.Module, moe: MoEConfig) -> SparseMoE:
    """SparseMoE loaded from the block's state (transformers 5's fused expert names)."""
    ours = SparseMoE(HIDDEN, moe)
    filled: dict[str, int] = {}
    for name, tensor in block.state_dict().items():
        for parameter, count in ours.load_hf(name, tensor).items():
            filled[parameter] = filled.get(parameter, 0) + count
    assert filled == {name: p.numel() for name, p in ours.named_parameters()}
    return ours


@pytest.mark.parametrize("family", sorted(BLOCKS))
def test_router_and_experts_match_transformers(family: str) -> None:
    block, moe = hf_block(family)
    ours = ours_from(block, moe)
    x = torch.randn(29, HIDDEN)
    with torch.no_grad():
        expected = block(x.unsqueeze(0))
        expected = (expected[0] if isinstance(expected, tuple) else expected).reshape(29, HIDDEN)
        _, hf_weights, hf_experts = block.gate(x)
        weights, experts = ours.router(x)
        got, loop = ours(x), ours.forward_reference(x)
    # The same experts with the same weights (as sets: top-k order is free).
    assert torch.equal(experts.sort(-1).values, hf_experts.sort(-1).values)
    by_expert = experts.argsort(-1), hf_experts.argsort(-1)
    assert torch.equal(weights.gather(1, by_expert[0]), hf_weights.float().gather(1, by_expert[1]))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loop, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", sorted(BLOCKS))
def test_bf16_experts_are_transformers_bit_for_bit(family: str) -> None:
    """In bf16 (the module path's plain matmuls, before packing) each expert runs on its rows
    in transformers' order, and each token's experts are added in ascending order, each add
    rounded, as transformers' eager experts add them: the same bits."""
    block, moe = hf_block(family)
    block = block.to(torch.bfloat16)
    ours = ours_from(block, moe).to(torch.bfloat16)
    x = torch.randn(29, HIDDEN).bfloat16()
    with torch.no_grad():
        expected = block(x.unsqueeze(0))
        expected = (expected[0] if isinstance(expected, tuple) else expected).reshape(29, HIDDEN)
        assert torch.equal(ours(x), expected)


def test_grouped_experts_are_the_reference_loop() -> None:
    torch.manual_seed(1)
    num_experts, tokens, top_k = 6, 40, 3
    gate_up, down = torch.randn(num_experts, 2 * 24, HIDDEN) * 0.2, torch.randn(num_experts, HIDDEN, 24) * 0.2
    x = torch.randn(tokens, HIDDEN)
    experts = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k)
    grouped = experts_grouped(x, gate_up, down, weights, experts)
    torch.testing.assert_close(grouped, experts_reference(x, gate_up, down, weights, experts), rtol=1e-5, atol=1e-5)
    # A token's result is its own: the same with the other tokens gone.
    alone = experts_grouped(x[7:8], gate_up, down, weights[7:8], experts[7:8])
    torch.testing.assert_close(alone, grouped[7:8], rtol=1e-5, atol=1e-5)
    bf16 = experts_grouped(x.bfloat16(), gate_up.bfloat16(), down.bfloat16(), weights, experts)
    assert bf16.dtype == torch.bfloat16
    assert (bf16.float() - grouped).abs().max() < 0.02 * grouped.abs().max()


def _packed_pairs(gate_up: torch.Tensor, down: torch.Tensor) -> list[tuple[Any, Any]]:
    """Each expert's two matmuls as their own packed layers (the reference for the grouped call)."""
    from kvloom.models.packed_linear import InvariantLinear
    return [(InvariantLinear(gate_up[e], None), InvariantLinear(down[e], None)) for e in range(gate_up.shape[0])]


def _torch_sum(x: torch.Tensor, gate_up_layers: list[tuple[Any, Any]], weights: torch.Tensor, experts: torch.Tensor,
               biases: tuple[torch.Tensor, torch.Tensor] | None, activation: Any) -> torch.Tensor:
    """The naive loop over the packed layers: each token's experts in ascending order, its
    output rounded, weighted, rounded and added onto zeros (rounded), in torch's ops."""
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for expert in sorted(int(e) for e in experts[token]):
            if expert >= len(gate_up_layers):
                continue  # another rank's
            slot = int((experts[token] == expert).nonzero())
            first, second = gate_up_layers[expert]
            y = first(x[token:token + 1])
            y = y if biases is None else y + biases[0][expert]
            y = second(activation(y))
            y = y if biases is None else y + biases[1][expert]
            out[token:token + 1] += (y * weights[token, slot]).to(x.dtype)
    return out


@pytest.mark.parametrize("tokens", [1, 3, 16, 70])
@pytest.mark.parametrize("form", ["plain", "bf16_weights", "biases", "other_ranks"])
def test_grouped_gemm_experts_are_the_per_expert_loop_bit_for_bit(tokens: int, form: str) -> None:
    """bf16 experts packed for the grouped GEMM (both matmuls of every expert a layer picks
    in two native calls, the weighted sum in one): the same bits as running each token's
    experts one by one through their own packed layers and adding with torch, for
    SwiGLU and GPT-OSS's clamped SwiGLU with biases, routing weights in float32 or bf16,
    and ids past the last expert (another rank's) skipped."""
    from kvloom.models.moe import GroupedExperts, expert_activation
    from kvloom.models.packed_linear import can_pack_invariant

    if not can_pack_invariant(torch.zeros(1, dtype=torch.bfloat16)):
        pytest.skip("no invariant GEMM on this CPU")
    from kvloom.kernels import gemm
    generator = torch.Generator().manual_seed(tokens)
    num_experts, top_k, inter = 12, 4, 40
    gate_up = (torch.randn(num_experts, 2 * inter, HIDDEN, generator=generator) * 0.3).bfloat16()
    down = (torch.randn(num_experts, HIDDEN, inter, generator=generator) * 0.3).bfloat16()
    x = torch.randn(tokens, HIDDEN, generator=generator).bfloat16()
    experts = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    if form == "other_ranks":  # this rank holds experts 0-7; the others' ids are 8, as SparseMoE masks them
        num_experts = 8
        experts = experts.clamp(max=8)
        experts = torch.stack([row if len(set(row.tolist())) == top_k else torch.tensor([8, 0, 1, 2])[:top_k]
                               for row in experts])
        gate_up, down = gate_up[:8], down[:8]
    weights = torch.rand(tokens, top_k, generator=generator)
    if form == "bf16_weights":
        weights = weights.bfloat16()
    biases = ((torch.randn(num_experts, 2 * inter, generator=generator).bfloat16(),
               torch.randn(num_experts, HIDDEN, generator=generator).bfloat16()) if form == "biases" else None)
    moe = MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=inter, sparse_layers=(0,),
                    hidden_act="swigluoai" if form == "biases" else "silu")
    activation = expert_activation(moe)
    gate_ups, downs = gemm.pack_weight_groups([list(gate_up.unbind()), list(down.unbind())])
    grouped = GroupedExperts(gate_ups, downs, 2 * inter, HIDDEN, gemm.default_isa())  # type: ignore[arg-type]
    got = experts_grouped(x, None, None, weights, experts, biases=biases, activation=activation, grouped=grouped)
    expected = _torch_sum(x, _packed_pairs(gate_up, down), weights, experts, biases, activation)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


def test_routing_edge_cases_ties_a_lone_expert_and_an_unused_one() -> None:
    """Router rows 0 and 1 are equal (their scores tie for every token); tokens prefer
    experts 0/1, token 5 alone prefers expert 3; expert 2 is nobody's choice, and its
    weights are NaN, so computing it at all would show."""
    moe = MoEConfig(num_experts=4, top_k=2, intermediate_size=8, sparse_layers=(0,), norm_topk_prob=True)
    ours = SparseMoE(4, moe)
    with torch.no_grad():
        ours.router.weight.copy_(torch.tensor([[4.0, 0, 0, 0], [4.0, 0, 0, 0], [-9.0, -9, -9, -9], [0, 0, 0, 4.0]]))
        ours.experts_gate_up.normal_()
        ours.experts_down.normal_()
        ours.experts_gate_up[2] = float("nan")
    x = torch.tensor([[1.0, 0.1, 0, 0]] * 5 + [[0, 0, 0, 1.0]] + [[1.0, 0, 0.2, 0]] * 2)
    weights, experts = ours.router(x)
    chosen = experts.sort(-1).values
    assert chosen[:5].tolist() == [[0, 1]] * 5 and chosen[6:].tolist() == [[0, 1]] * 2
    assert 3 in chosen[5].tolist() and (chosen == 3).sum() == 1
    assert not (chosen == 2).any()
    assert torch.equal(weights[0, 0], weights[0, 1])  # a tie, renormalised to halves
    out = ours(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ours.forward_reference(x))
    one = ours(x[5:6])  # a decode of one token: its two experts, nobody else's
    torch.testing.assert_close(one, out[5:6])


def test_ties_choose_the_experts_transformers_chooses() -> None:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    hf = MixtralTopKRouter(MixtralConfig(hidden_size=4, num_local_experts=6, num_experts_per_tok=2))
    with torch.no_grad():
        hf.weight.copy_(torch.tensor([[1.0, 0, 0, 0]] * 6))  # every expert ties
    x = torch.randn(9, 4)
    moe = MoEConfig(num_experts=6, top_k=2, intermediate_size=8, sparse_layers=(0,), norm_topk_prob=True)
    weights, experts = route(torch.nn.functional.linear(x, hf.weight), moe)
    _, hf_weights, hf_experts = hf(x)
    assert torch.equal(experts.sort(-1).values, hf_experts.sort(-1).values)
    assert torch.equal(weights, torch.full_like(weights, 0.5))


def test_config_from_hf_picks_the_sparse_layers() -> None:
    base = dict(num_hidden_layers=6, intermediate_size=64, hidden_act="silu")
    assert MoEConfig.from_hf({"architectures": ["LlamaForCausalLM"], **base}) is None
    mixtral = MoEConfig.from_hf({"architectures": ["MixtralForCausalLM"], "num_local_experts": 8, **base})
    assert mixtral is not None and mixtral.sparse_layers == tuple(range(6)) and mixtral.norm_topk_prob
    qwen = MoEConfig.from_hf({"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
                              "decoder_sparse_step": 2, "mlp_only_layers": [3], **base})
    assert qwen is not None and qwen.sparse_layers == (1, 5) and qwen.shared_expert_gate
    assert qwen.shared_expert_intermediate_size == 5632  # HF's default where the key is absent
    v2 = MoEConfig.from_hf({"architectures": ["DeepseekV2ForCausalLM"], "n_routed_experts": 8,
                            "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 2,
                            "moe_intermediate_size": 16, "n_shared_experts": 2, "norm_topk_prob": True, **base})
    assert v2 is not None and v2.sparse_layers == (2, 4) and v2.shared_expert_intermediate_size == 32
    assert not v2.norm_topk_prob and v2.router_float32  # transformers' V2 router never renormalises
    v3 = MoEConfig.from_hf({"architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 8, "n_group": 2,
                            "topk_group": 1, "first_k_dense_replace": 0, **base})
    assert v3 is not None and v3.sparse_layers == tuple(range(6))
    assert (v3.topk_method, v3.scoring, v3.score_correction_bias, v3.norm_topk_prob) == ("noaux_tc", "sigmoid",
                                                                                       True, True)
    with pytest.raises(ValueError, match="topk_method"):
        MoEConfig.from_hf({"architectures": ["DeepseekV2ForCausalLM"], "n_routed_experts": 8,
                           "num_experts_per_tok": 2, "topk_method": "noaux_tc", **base})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoEConfig(num_experts=4, top_k=5, intermediate_size=8, sparse_layers=(0,))


def test_deepseek_router_stays_float32_in_bfloat16() -> None:
    block, moe = hf_block("deepseek_v3")
    ours = ours_from(block, moe).to(torch.bfloat16)
    assert ours.router.weight.dtype == torch.float32 and ours.router.score_correction_bias is not None
    assert ours.router.score_correction_bias.dtype == torch.float32
    assert ours.experts_gate_up.dtype == torch.bfloat16
    out = ours(torch.randn(5, HIDDEN, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


class _Rank:
    """A rank's place without a process group: ``all_reduce`` returns its partial sum."""

    def __init__(self, rank: int, size: int, expert_parallel: bool = False) -> None:
        self.rank, self.size, self.expert_parallel = rank, size, expert_parallel

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["features", "experts"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_two_ranks_partial_sums_add_up_to_the_whole(family: str, expert_parallel: bool) -> None:
    """Each rank reads its weight_slice of every expert (hub names: one tensor per
    expert) and of the fused tensors: a share of every expert's features, or (expert
    parallel) half the experts whole; the two partial outputs sum to one process's."""
    block, moe = hf_block(family)
    whole = ours_from(block, moe)
    hub = {}
    for name, tensor in block.state_dict().items():
        if name == "experts.gate_up_proj":
            for expert, fused in enumerate(tensor):
                gate, up = fused.chunk(2)
                hub[f"experts.{expert}.w1.weight"], hub[f"experts.{expert}.w3.weight"] = gate, up
        elif name == "experts.down_proj":
            hub.update({f"experts.{expert}.w2.weight": t for expert, t in enumerate(tensor)})
        else:
            hub[name] = tensor
    x = torch.randn(11, HIDDEN)
    partials = []
    for rank in range(2):
        shard = SparseMoE(HIDDEN, moe, _Rank(rank, 2, expert_parallel))  # type: ignore[arg-type]
        for name, tensor in hub.items():
            part = shard.weight_slice(name)
            shard.load_hf(name, tensor if part is None else tensor.narrow(part.dim, part.start, part.end - part.start))
        fused = SparseMoE(HIDDEN, moe, _Rank(rank, 2, expert_parallel))  # type: ignore[arg-type]
        for name, tensor in block.state_dict().items():
            part = fused.weight_slice(name)
            fused.load_hf(name, tensor if part is None else tensor.narrow(part.dim, part.start, part.end - part.start))
        assert all(torch.equal(a, b) for a, b in zip(shard.parameters(), fused.parameters(), strict=True))
        with torch.no_grad():
            partials.append(shard(x))
    with torch.no_grad():
        torch.testing.assert_close(partials[0] + partials[1], whole(x), rtol=1e-5, atol=1e-5)


def test_tensor_parallel_slices_and_problems() -> None:
    moe = MoEConfig(num_experts=4, top_k=2, intermediate_size=96, sparse_layers=(0, 1),
                    shared_expert_intermediate_size=40, shared_expert_gate=True)
    config = ModelConfig("Qwen2MoeForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=100,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, moe=moe)
    assert llama_weight_slice(config, "model.layers.1.mlp.experts.3.gate_proj.weight", 1, 2) == TensorSlice(0, 48, 96)
    assert llama_weight_slice(config, "model.layers.0.block_sparse_moe.experts.0.w2.weight", 0, 2) == TensorSlice(
        1, 0, 48)
    assert moe_weight_slice(moe, "experts.down_proj", 1, 2) == TensorSlice(2, 48, 96)
    assert moe_weight_slice(moe, "shared_expert.up_proj.weight", 1, 2) == TensorSlice(0, 20, 40)
    for replicated in ("gate.weight", "shared_expert_gate.weight", "experts.gate_up_proj"):
        assert moe_weight_slice(moe, replicated, 1, 2) is None
    assert tensor_parallel_problem(config, 2) is None  # every layer is sparse: the dense size does not matter
    problem = tensor_parallel_problem(config, 3)
    assert problem is not None and "experts' intermediate size (96)" not in problem
    assert "shared expert's intermediate size (40)" in problem


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("moe") / "mixtral", arch="mixtral", seed=1,
                               num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layer 1 dense (mlp_only_layers), layer 0 sparse with a gated shared expert; q/k/v bias."""
    return write_tiny_hf_model(tmp_path_factory.mktemp("moe") / "qwen2_moe", arch="qwen2_moe", seed=2,
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=True)


@pytest.fixture(scope="module")
def qwen2_moe_no_bias(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """qkv_bias false: Qwen2-MoE's name for the flag (no q/k/v bias at all)."""
    return write_tiny_hf_model(tmp_path_factory.mktemp("moe") / "qwen2_moe_no_bias", arch="qwen2_moe", seed=3,
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=48, qkv_bias=False)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-MoE: Qwen2-MoE's routing without a shared expert, Qwen3's q/k norms, and one
    dense layer (mlp_only_layers)."""
    return write_tiny_hf_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", arch="qwen3_moe", seed=4,
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                               mlp_only_layers=[1])


# A 14-block pool for prompts of up to 5 blocks with 12 tokens out, 24-token steps:
# prefills are chunked, requests batch together and some are preempted.
PROMPTS = [[(11 * i + 7 * j) % 500 + 5 for j in range(n)] for i, n in enumerate([1, 7, 20, 33, 41, 64])]
ENGINE = dict(dtype="float32", block_size=16, num_blocks=14, max_num_batched_tokens=24)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen2_moe_no_bias", "qwen3_moe"])
def test_greedy_tokens_are_transformers(arch: str, request: pytest.FixtureRequest) -> None:
    import transformers

    path: Path = request.getfixturevalue(arch)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                  experts_implementation="eager").eval()
    expected = [hf_greedy_with_cache(reference, prompt, 12) for prompt in PROMPTS]
    llm = LLM(str(path), **ENGINE)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.num_available_blocks == 14


def test_hub_and_fused_expert_names_load_the_same(mixtral: Path, qwen2_moe: Path) -> None:
    """save_pretrained (transformers 5.24) writes the hub's per-expert names; the loaded
    model's state_dict has the fused 3D ones. Both give the same parameters; a name that
    is no expert's is refused."""
    import transformers

    from kvloom.models.loader import load_checkpoint

    for path in (mixtral, qwen2_moe):
        checkpoint = load_checkpoint(str(path))
        config = ModelConfig.from_hf(checkpoint.hf_config)
        from_hub, from_fused = LlamaForCausalLM(config, 64), LlamaForCausalLM(config, 64)
        from_hub.load_weights(checkpoint.weights())
        assert any(".experts.0." in name for name, _ in checkpoint.weights())
        state = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
        assert any(name.endswith("experts.gate_up_proj") for name in state)
        from_fused.load_weights(state.items())
        for (name, a), (_, b) in zip(from_hub.named_parameters(), from_fused.named_parameters(), strict=True):
            assert torch.equal(a, b), name
        with pytest.raises(ValueError, match="names expert 9"):
            from_fused.load_weights([("model.layers.0.mlp.experts.9.up_proj.weight", torch.zeros(1))])


def test_bfloat16_experts_are_packed_and_batch_invariant(mixtral: Path, qwen2_moe: Path) -> None:
    """bf16 on a CPU with kvloom's invariant GEMM: every expert's matmuls (and the router,
    the shared gate) are packed, so a prompt's greedy tokens do not depend on what else
    is in its batch; their layers run in the native walk."""
    from kvloom.models.packed_linear import InvariantLinear, can_pack_invariant
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for path in (mixtral, qwen2_moe):
        llm = LLM(str(path), dtype="bfloat16", block_size=16, num_blocks=64)
        batched = llm.generate(PROMPTS, params)
        alone = [llm.generate([prompt], params)[0] for prompt in PROMPTS]
        assert all(len(o.outputs[0].token_ids) == 6 for o in batched)
        model = llm.engine.model
        llm.engine.check_integrity()
        moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE))
        if not can_pack_invariant(torch.zeros(1, dtype=torch.bfloat16)):
            continue  # no invariant GEMM on this CPU: nothing to hold the batch to
        assert moe.packed_experts is not None and isinstance(moe.router.packed, InvariantLinear)
        assert not hasattr(moe, "experts_gate_up")  # released once packed
        # The block's experts are views into one buffer: every gate/up weight, then every
        # down weight (the grouped GEMM's two stacks).
        views = [pair[0].packed_weight for pair in moe.packed_experts] + [
            pair[1].packed_weight for pair in moe.packed_experts]
        assert len({view.untyped_storage().data_ptr() for view in views}) == 1
        starts = [view.data_ptr() for view in views]
        assert starts == sorted(starts) and len(set(starts)) == len(starts)
        assert moe.grouped is not None
        assert [moe.grouped.gate_up[e].data_ptr() for e in range(len(moe.packed_experts))] == starts[:len(views) // 2]
        assert moe.grouped.down[0].data_ptr() == starts[len(views) // 2]
        assert [o.outputs[0].token_ids for o in batched] == [o.outputs[0].token_ids for o in alone]
