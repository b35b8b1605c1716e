"""The native walk over the decoder layers (models/decoder_stack.py,
csrc/decoder_stack.cpp) against the module path it replaces: the same hidden states
and the same KV cache, bit for bit, on every step of a run that mixes fresh prefills,
chunked prefills, prefix-cache hits and decodes; each path's last layer for the sampled
rows alone against the same path computing every row; and the configurations it
leaves to the modules; and steps with LoRA adapter rows, which the walk runs too."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.kernels import decoder_stack, gemm, paged_attention
from kvloom.lora.request import LoRARequest
from kvloom.models import decoder_stack as stack_model
from kvloom.models.decoder_stack import split_point
from kvloom.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not (decoder_stack.available() and paged_attention.paired_layout(32, 16)),
    reason="the native walk needs the bf16 paired-layout kernels (AVX2 or AVX-512)")

# head_dim 32: a shape the paired layout serves.
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=3)


# qwen2: q/k/v biases; qwen3: q/k norms; granite: its multipliers (the residual one in the walk);
# phi3: Phi-4-mini's partial rotary (the first 3/4 of each head); mistral: a sliding window of
# 20 keys (the prompts below pass it) and heads of 256 dims (Gemma's width, in a Llama)
# smollm3: no rotary in its second layer (an interval of 2: the shape's three layers hold one)
# gemma: norms by 1 + weight in float32, GeGLU; gemma2: block norms around attention and MLP,
# windowed layers beside full ones, the scores softcapped; gemma3: its windowed layers'
# own rotary table and Gemma's q/k head norms; helium: RMSNorms scaled in float32; olmo2:
# no input norm, each block's output normed and added, q/k norms over the whole projection;
# olmo3: its windowed layers' own rotary; exaone4: OLMo 2's layer with Llama's norms, q/k
# norms of a head, a global layer without rotary; starcoder2: LayerNorms, an un-gated GELU MLP,
# biases, a window; gpt2: its layer with no rotary (learned positions), Conv1D weights; phi:
# attention and MLP side by side on one LayerNorm, a partial rotary; gpt_neox (Pythia): side by
# side on two LayerNorms, GELU's exact form; gpt_neox_seq: its blocks in turn; stablelm: LayerNorms
# and SwiGLU, a partial rotary; stablelm_parallel: side by side, the attention added in first;
# olmo1: LayerNorms without weights, q/k/v clipped after the projection; opt: GPT-2's layer with a
# ReLU MLP, positions two rows ahead; cohere2: side by side on one bias-free LayerNorm, adjacent-pair
# rotary (rows regrouped), windowed layers beside a full one without rotary; nemotron: LayerNorms by
# 1 + weight, ReLU squared, half of each head turned; glm4: Gemma 2's block norms in Llama's RMSNorms,
# adjacent pairs of half of each head turned (those rows regrouped).
@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "granite", "phi3", "mistral", "smollm3",
                                        "gemma", "gemma2", "gemma3", "helium", "olmo2", "olmo3", "exaone4",
                                        "starcoder2", "gpt2", "phi", "gpt_neox", "gpt_neox_seq", "stablelm",
                                        "stablelm_parallel", "olmo1", "opt", "cohere2",
                                        "nemotron", "glm4"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_family(request.param, tmp_path_factory)


# The KV fetched ahead is each layer's blocks, whatever the layer: its budgets are held on a
# few layer kinds (Llama's, Gemma 2's windows and block norms, Phi's side by side, OLMo 2's
# norms after each block); every family's split walks run with the default budget.
@pytest.fixture(scope="module", params=["llama", "gemma2", "phi", "olmo2"])
def prefetch_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_family(request.param, tmp_path_factory)


def write_family(name: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight model of the configuration ``name`` (the comment above model_dir)."""
    from helpers_models import write_tiny_hf_model

    extra: dict = {"head_dim": 32} if name in ("qwen3", "gemma", "helium") else {}  # not derived by them
    if name == "gemma2":
        extra = dict(head_dim=32, sliding_window=20, query_pre_attn_scalar=19, attn_logit_softcapping=0.5)
    if name == "starcoder2":
        extra = dict(sliding_window=20)
    shape: dict = SHAPE
    if name == "gpt2":  # no KV heads of its own; 128 learned positions (the run's longest is 77)
        shape = dict(hidden_size=128, n_inner=256, num_attention_heads=4, num_hidden_layers=3,
                     max_position_embeddings=128)
    if name == "glm4":
        extra = dict(head_dim=32)
    if name == "cohere2":
        extra = dict(sliding_window=20, sliding_window_pattern=3)
    if name == "opt":  # no KV heads of its own; its MLP's width is ffn_dim
        shape = dict(hidden_size=128, ffn_dim=256, num_attention_heads=4, num_hidden_layers=3,
                     max_position_embeddings=128)
    if name.startswith("gpt_neox"):  # no KV heads of its own
        shape = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_hidden_layers=3)
        extra = dict(rotary_pct=0.25, use_parallel_residual=name == "gpt_neox")
    mixed = ["sliding_attention", "full_attention", "sliding_attention"]
    if name == "olmo3":
        extra = dict(sliding_window=20, layer_types=mixed, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}})
    if name == "exaone4":
        extra = dict(head_dim=32, sliding_window=20, layer_types=mixed)
    if name == "gemma3":
        extra = dict(head_dim=32, sliding_window=20, query_pre_attn_scalar=19, rope_theta=1_000_000.0,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    if name == "mistral":
        extra = dict(sliding_window=20, head_dim=256)
    if name == "phi3":
        extra = dict(partial_rotary_factor=0.75)
    if name == "smollm3":
        extra = dict(no_rope_layer_interval=2)
    if name == "granite":
        extra = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                     logits_scaling=8.0)
    if name == "stablelm_parallel":
        extra = dict(use_parallel_residual=True)
    if name == "olmo1":
        extra = dict(clip_qkv=0.5)
    arch = {"gpt_neox_seq": "gpt_neox", "stablelm_parallel": "stablelm", "olmo1": "olmo"}.get(name,
                                                                                              name)
    return write_tiny_hf_model(tmp_path_factory.mktemp(name), arch=arch, **shape, **extra)


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest | None]:
    """Two PEFT adapters of the model (every projection at rank 8; attention and down at
    rank 4), each request's in the run_both_paths order, None for the base model."""
    from helpers_lora import family_targets, write_adapter
    every, some = family_targets(model_dir)  # the family's names (Phi's fc1, GPT-2's c_attn, ...)
    root = tmp_path_factory.mktemp("adapters")
    a = LoRARequest("a", 1, str(write_adapter(model_dir, root / "a", 1, 8, every)))
    b = LoRARequest("b", 2, str(write_adapter(model_dir, root / "b", 2, 4, some)))
    # a's rows apart in some steps (gathered, not one run); the last request hits a's prefix.
    return [a, None, a, b, a]


def run_both_paths(model_dir: Path, loras: list[LoRARequest | None] | None = None) -> list[list[int]]:
    """A run mixing fresh prefills, chunked prefills, a prefix-cache hit and decodes, each
    step computed by the walk and by the module path, which must agree bit for bit (the
    hidden states and the KV cache); where the step reads some rows only (output_rows),
    each path also computes every row (the last layer whole), and the rows read must be
    those bits too. ``loras``: each request's adapter (the walk then runs the steps with
    adapter rows too). Returns each step's query lengths."""
    engine = LLMEngine(EngineConfig.from_kwargs(str(model_dir), dtype="bfloat16", max_num_batched_tokens=40,
                                                num_blocks=96, block_size=16, seed=0, enable_lora=loras is not None,
                                                max_loras=2, max_lora_rank=8))
    model: Any = engine.model
    assert model.native_stack is not None
    forward, steps, narrowed, adapted, narrowed_adapted = model.forward, [], [], [], []

    def modules(batch: Any, kv_caches: torch.Tensor, backend: Any, metadata: Any) -> torch.Tensor:
        stack, model.native_stack = model.native_stack, None
        try:
            return forward(batch, kv_caches, backend, metadata)  # type: ignore[no-any-return]
        finally:
            model.native_stack = stack

    # A hybrid's state layers keep each request's state in its slot, which a forward moves on:
    # every path of a step starts from the states the step found, and the walk must leave
    # the module path's.
    states = [tensor for layer in model.native_stack.state_layers.values()
              for tensor in (layer.conv_state, getattr(layer, "ssm_state", None)) if tensor is not None]

    def from_states(path: Any, found: list[torch.Tensor], *args: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``path`` run from the ``found`` states; its result and the states it leaves."""
        for tensor, values in zip(states, found, strict=True):
            tensor.copy_(values)
        return path(*args), [tensor.clone() for tensor in states]

    def both_paths(batch: Any, kv_caches: torch.Tensor, backend: Any, metadata: Any) -> torch.Tensor:
        assert model.native_stack.serves(kv_caches, backend, metadata, batch.lora_slots is not None)  # it runs below
        if batch.lora_slots is not None:
            adapted.append(batch.lora_slots)
        found = [tensor.clone() for tensor in states]
        modules_cache = kv_caches.clone()
        expected, expected_states = from_states(modules, found, batch, modules_cache, backend, metadata)
        if batch.output_rows is not None:  # every row, then the rows read, on both paths
            whole, whole_cache = dataclasses.replace(batch, output_rows=None), kv_caches.clone()
            for path, cache in ((modules, whole_cache.clone()), (forward, whole_cache)):
                every_row, left = from_states(path, found, whole, cache, backend, metadata)
                assert every_row.shape[0] == batch.num_tokens
                assert torch.equal(every_row[batch.output_rows], expected), f"rows read differ on step {len(steps)}"
                assert all(map(torch.equal, left, expected_states)), f"every row's states differ on step {len(steps)}"
            narrowed.append(batch.output_rows.numel())
            if batch.lora_slots is not None:
                narrowed_adapted.append(batch.output_rows.numel())
        got, left = from_states(forward, found, batch, kv_caches, backend, metadata)
        assert got.shape[0] == (batch.num_tokens if batch.output_rows is None else batch.output_rows.numel())
        assert torch.equal(got, expected), f"hidden states differ on step {len(steps)}"
        assert torch.equal(kv_caches, modules_cache), f"the KV cache differs on step {len(steps)}"
        assert all(map(torch.equal, left, expected_states)), f"the state layers' states differ on step {len(steps)}"
        if batch.output_rows is not None:
            assert torch.equal(kv_caches, whole_cache), f"the KV cache differs from every row's on step {len(steps)}"
        steps.append(batch.query_lens_list)
        return got

    model.forward = both_paths
    shared = [(7 * i) % 200 + 3 for i in range(37)]  # two full blocks and a bit, shared
    # The 65-token prompt first: its first chunk fills a step and samples nowhere.
    prompts = [list(range(5, 70)), shared + [11, 12, 13], shared + [21], [9, 8, 7]]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.8, seed=3, ignore_eos=True)]
    loras = loras or [None] * 5
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, params[index % 2], lora_request=loras[index])
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request(shared + [31, 32], params[0], lora_request=loras[4])  # a prefix-cache hit after the others
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.num_cached_prompt_tokens >= 32
    assert any(len(lens) > 1 and max(lens) > 1 and min(lens) == 1 for lens in steps), "no mixed step"
    assert any(max(lens) == 1 for lens in steps), "no pure decode step"
    if any(lora is not None for lora in loras):
        # Some step holds one adapter's sequences apart (their rows gathered), and most hold adapter rows.
        assert any(slot >= 0 and slot in slots[i + 1:] and slots[i + 1] != slot
                   for slots in adapted for i, slot in enumerate(slots[:-1])), adapted
        assert len(adapted) >= len(steps) // 2, (len(adapted), len(steps))
        assert any(count > 0 for count in narrowed_adapted), narrowed_adapted  # adapter rows in a narrowed last layer
    assert 0 in narrowed and any(count > 0 for count in narrowed), narrowed  # chunks that sample nowhere, and some
    return steps


def local_tables(engine: LLMEngine, tokens: int, width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A rotary table for the layers that turn by their own (Gemma 3's windowed layers), None where none do."""
    if engine.model.local_rotary is None:  # type: ignore[attr-defined]
        return None
    return torch.full((tokens, width), 0.5), torch.full((tokens, width), 0.25)


def test_every_step_matches_the_module_path_bit_for_bit(model_dir: Path) -> None:
    run_both_paths(model_dir)


# Hybrid stacks, state layers beside attention layers, each followed by Llama's MLP: bamba
# (Mamba2 mixers, half of each head turned, its last layer a mixer: the rows read are narrowed
# there); granite4: IBM Granite 4.0 as published (no rotary, Granite's multipliers, the shared
# MLP as the dense one), attention last; granite4_rope: its rotary over the whole head, a mixer
# last; lfm2: LiquidAI LFM2's gated short convolutions and attention with per-head q/k norms, a
# convolution last; nemotron_h: NVIDIA Nemotron-H's single-mixer blocks paired as layers (an MLP
# block after no other, a mixer with no MLP after it, attention and its MLP, a mixer last);
# nemotron_h_mlp_last: an MLP block alone last (the rows read narrowed there); granite4_moe: IBM
# Granite 4.0's routed experts (4, top 2) beside the shared MLP in every layer (granite-4.0-h-tiny's form);
# lfm2_moe: LFM2's layers, the first with a dense MLP, then experts of another width chosen by sigmoid
# scores steered by a selection bias (LFM2-8B-A1B's form); nemotron_h_moe: Nemotron 3's MoE blocks
# (experts of up alone through ReLU squared, a shared one beside them, a float32 router by groups)
# after a mixer, after the attention and last, among a dense MLP block.
@pytest.fixture(scope="module", params=["bamba", "granite4", "granite4_rope", "lfm2", "nemotron_h",
                                        "nemotron_h_mlp_last", "granite4_moe", "lfm2_moe", "nemotron_h_moe"])
def hybrid_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers_ssm import write_tiny_ssm_model

    root, name = tmp_path_factory.mktemp(request.param), request.param
    if name == "bamba":  # head_dim 32 (the paired layout); the mixers' heads of 64, 2 groups
        return write_tiny_ssm_model(root, "bamba", hidden_size=128, intermediate_size=256, attn_layer_indices=[1])
    if name in ("lfm2", "lfm2_moe"):
        return write_tiny_ssm_model(root, name, hidden_size=128, num_hidden_layers=3,
                                    layer_types=["conv", "full_attention", "conv"])
    if name == "nemotron_h_moe":
        return write_tiny_ssm_model(root, name, hidden_size=128, head_dim=32,
                                    layers_block_type=["mamba", "moe", "attention", "moe", "mlp", "mamba", "moe"])
    if name.startswith("nemotron_h"):
        blocks = (["mlp", "mamba", "attention", "mlp", "mamba"] if name == "nemotron_h"
                  else ["mamba", "attention", "mlp", "mlp"])
        return write_tiny_ssm_model(root, "nemotron_h", hidden_size=128, head_dim=32, layers_block_type=blocks)
    layers = ["mamba", "mamba", "attention"] if name in ("granite4", "granite4_moe") else ["attention", "mamba",
                                                                                           "mamba"]
    return write_tiny_ssm_model(root, "granite_hybrid", hidden_size=128, shared_intermediate_size=256,
                                intermediate_size=64, num_hidden_layers=3, layer_types=layers,
                                num_local_experts=4 if name == "granite4_moe" else 0,
                                position_embedding_type="rope" if name == "granite4_rope" else None)


def test_hybrid_steps_match_the_module_path_bit_for_bit(hybrid_dir: Path) -> None:
    """Every step of the mixed run, walked and as modules: the hidden states, the KV cache
    and every state layer's states in the requests' slots, bit for bit."""
    run_both_paths(hybrid_dir)


def test_hybrid_two_concurrent_walks_match_the_module_path_bit_for_bit(hybrid_dir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each walk takes its sequences' spans, the second's from its own first row."""
    run_split(hybrid_dir, monkeypatch, 8 << 20)


def test_a_hybrids_spans_are_checked_before_any_pointer_reaches_c(hybrid_dir: Path) -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(str(hybrid_dir), dtype="bfloat16", num_blocks=32))
    stack: Any = engine.model.native_stack  # type: ignore[attr-defined]
    tokens = 3
    rows = decoder_stack.StackRows(torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                                   torch.tensor([0], dtype=torch.int32), torch.tensor([3], dtype=torch.int32))
    width = stack.shape.rotary_dim or stack.shape.head_dim
    args: dict[str, Any] = dict(residual=torch.zeros(tokens, 128, dtype=torch.bfloat16),
                                kv_caches=engine.runner.kv_caches, cos=torch.ones(tokens, width),
                                sin=torch.zeros(tokens, width), slots=torch.arange(tokens), rows=rows, scale=0.1)
    spans = decoder_stack.StackSpans(torch.tensor([0]), torch.tensor([2]), torch.tensor([0]),
                                     torch.tensor([0], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="weights have a state layer without its state tensors"):  # before a step
        decoder_stack.run(stack.kernels, stack.weights, stack.shape, spans=dataclasses.replace(
            spans, lengths=torch.tensor([3])), **args)
    stack._bind_states()
    for bad, message in ((None, "spans must be given: the model's layers keep states"),
                         (spans, r"spans.lengths must sum to the step's 3 rows, got \[2\]"),
                         (dataclasses.replace(spans, lengths=torch.tensor([3]),
                                              slots=torch.tensor([0], dtype=torch.int32)),
                          r"spans.slots must be a contiguous \[1\] torch.int64")):
        with pytest.raises(ValueError, match=f"kvloom decoder_stack: {message}"):
            decoder_stack.run(stack.kernels, stack.weights, stack.shape, spans=bad, **args)
    with pytest.raises(RuntimeError, match="a state layer's kernel refused the step's requests"):  # slot 9 of 4
        decoder_stack.run(stack.kernels, stack.weights, stack.shape, **args, spans=dataclasses.replace(
            spans, lengths=torch.tensor([3]), slots=torch.tensor([9])))


# Mixture-of-experts stacks, the experts' FFN walked (the router's logits, kvloom::moe_route, the
# grouped experts, the weighted sum): mixtral (8 experts, top 2, renormalised); qwen3_moe: per-head
# q/k norms, top 3 of 8 renormalised, its middle layer a dense MLP (mlp_only_layers); olmoe: q/k
# norms over the whole projection, top 2 of 8 as scored; granite_moe: Granite's multipliers over
# Mixtral's routing; qwen2_moe: q/k/v biases and a shared expert gated by a sigmoid beside the routed ones.
@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "olmoe", "granite_moe", "qwen2_moe"])
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers_models import write_tiny_hf_model

    name = request.param
    experts: dict[str, Any] = {
        "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
        "qwen3_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=64, norm_topk_prob=True,
                          mlp_only_layers=[1], head_dim=32),
        "olmoe": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
        "granite_moe": dict(num_local_experts=8, num_experts_per_tok=2, embedding_multiplier=12.0,
                            residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=8.0),
        "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                          shared_expert_intermediate_size=96),
    }[name]
    return write_tiny_hf_model(tmp_path_factory.mktemp(name), arch=name, **SHAPE, **experts)


def test_moe_steps_match_the_module_path_bit_for_bit(moe_dir: Path) -> None:
    run_both_paths(moe_dir)


def test_moe_two_concurrent_walks_match_the_module_path_bit_for_bit(moe_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    run_split(moe_dir, monkeypatch, 8 << 20)


def test_moe_steps_with_lora_adapters_match_the_module_path_bit_for_bit(moe_dir: Path,
                                                                        tmp_path: Path) -> None:
    """Adapters on a mixture-of-experts model's attention run in the walk, its experts as the
    modules run them."""
    from helpers_lora import write_adapter
    a = LoRARequest("a", 1, str(write_adapter(moe_dir, tmp_path / "a", 1, 8, ["q_proj", "k_proj", "v_proj", "o_proj"])))
    b = LoRARequest("b", 2, str(write_adapter(moe_dir, tmp_path / "b", 2, 4, ["q_proj", "v_proj"])))
    run_both_paths(moe_dir, [a, None, a, b, a])


def test_an_adapter_on_routed_experts_sends_adapter_steps_to_the_modules(tmp_path: Path) -> None:
    """While a slot holds deltas on the routed experts (which the walk does not add) the walk has
    no adapters' table: steps with adapter rows take the module path, the others the walk."""
    from helpers_lora import write_adapter
    from helpers_models import write_tiny_hf_model

    path = write_tiny_hf_model(tmp_path / "mixtral", arch="mixtral", **SHAPE, num_local_experts=4,
                               num_experts_per_tok=2)
    attention = write_adapter(path, tmp_path / "attention", 1, 8, ["q_proj", "o_proj"])
    experts = write_adapter(path, tmp_path / "experts", 2, 8, None,
                            target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    engine = LLMEngine(EngineConfig.from_kwargs(str(path), dtype="bfloat16", num_blocks=32, enable_lora=True,
                                                max_lora_rank=8))
    stack: Any = engine.model.native_stack  # type: ignore[attr-defined]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for name, adapter, table in (("attention", attention, True), ("experts", experts, False)):
        engine.add_request([5, 6, 7], params, lora_request=LoRARequest(name, len(name), str(adapter)))
        while engine.has_unfinished_requests():
            engine.step()
        assert (stack.lora is not None) is table, name
    engine.check_integrity()


def test_moe_layers_the_walk_does_not_run_are_named() -> None:
    """Experts with biases and a clamped SwiGLU (GPT-OSS's), a router that picks by logit before its
    softmax (GPT-OSS's rule) and unpacked experts keep the modules, each refusal saying why."""
    from kvloom.model_families import MoEConfig
    from kvloom.models.moe import SparseMoE

    def packed(moe: MoEConfig) -> SparseMoE:
        layer = SparseMoE(64, moe).to(torch.bfloat16)
        layer.pack("invariant")
        layer.router.pack("invariant")
        return layer

    base = dict(num_experts=8, top_k=2, intermediate_size=32, sparse_layers=(0,))
    gpt_oss = packed(MoEConfig(**base, hidden_act="swigluoai", expert_biases=True))
    picked_first = packed(MoEConfig(**base, scoring="topk_softmax"))
    assert "experts other than the walk's" in stack_model._why_not_walked_moe(gpt_oss, "in_turn")
    assert "not one of the walk's top-k rules" in stack_model._why_not_walked_moe(picked_first, "in_turn")
    assert "not packed for kvloom's GEMM" in stack_model._why_not_walked_moe(SparseMoE(64, MoEConfig(**base)),
                                                                               "in_turn")
    assert stack_model._why_not_walked_moe(packed(MoEConfig(**base)), "in_turn") == ""


# DeepSeek's latent attention walked (csrc/decoder_stack.cpp's latent_block): v2, a plain query
# projection, interleaved rotary pairs, a dense first layer twice the shared expert's width beside
# the routed experts (a softmax's top 2, unscaled); v2_groups, the query through q_a_proj and its
# norm, the top 2 from the better of two groups (group_limited_greedy), scaled; v3, q_a_proj, the
# rotary's halves, sigmoid scores steered by a bias, the better of two groups by their best two
# (noaux_tc), renormalised and scaled.
LATENT_SHAPES = {
    "v2": ("deepseek_v2", dict(q_lora_rank=None)),
    "v2_groups": ("deepseek_v2", dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=2, topk_group=1,
                                      routed_scaling_factor=1.5)),
    "v3": ("deepseek_v3", dict(q_lora_rank=24, n_group=2, topk_group=1, rope_interleave=False, norm_topk_prob=True,
                               routed_scaling_factor=2.5)),
}


@pytest.fixture(scope="module", params=sorted(LATENT_SHAPES))
def latent_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers_models import write_tiny_hf_model

    arch, overrides = LATENT_SHAPES[request.param]
    return write_tiny_hf_model(tmp_path_factory.mktemp(request.param), arch=arch, hidden_size=128,
                               intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                               num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                               v_head_dim=24, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32, n_shared_experts=1, **overrides)


@pytest.mark.skipif(not decoder_stack.latent_available(), reason="kvloom/csrc/latent_attention.cpp does not build here")
def test_latent_attention_steps_match_the_module_path_bit_for_bit(latent_dir: Path) -> None:
    run_both_paths(latent_dir)


@pytest.mark.skipif(not decoder_stack.latent_available(), reason="kvloom/csrc/latent_attention.cpp does not build here")
def test_latent_attention_two_concurrent_walks_match_the_module_path_bit_for_bit(
        latent_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_split(latent_dir, monkeypatch, 8 << 20)


@pytest.mark.skipif(not decoder_stack.latent_available(), reason="kvloom/csrc/latent_attention.cpp does not build here")
def test_latent_layers_the_walk_does_not_run_are_named(latent_dir: Path) -> None:
    """A latent attention unpacked keeps the modules, saying why (under tensor parallel it runs:
    tests/distributed/test_tensor_parallel.py); a
    float32 router whose rule is not kvloom::moe_route's keeps the whole model on them; steps on
    the PyTorch latent backend are not the walk's (and run)."""
    from kvloom.model_families import MoEConfig
    from kvloom.models.deepseek import LatentAttention
    from kvloom.models.moe import SparseMoE

    engine = LLMEngine(EngineConfig.from_kwargs(str(latent_dir), dtype="bfloat16", num_blocks=32,
                                                attention_backend="mla_batched"))
    model: Any = engine.model
    attention = model.layers[0].self_attn
    assert stack_model._why_not_walked_latent(attention) == ""
    unpacked = LatentAttention(model.config, attention.mla)
    assert "not packed for kvloom's GEMM" in stack_model._why_not_walked_latent(unpacked)
    picked_first = SparseMoE(64, MoEConfig(num_experts=8, top_k=2, intermediate_size=32, sparse_layers=(0,),
                                           scoring="topk_softmax", router_float32=True)).to(torch.bfloat16)
    picked_first.pack("invariant")
    picked_first.router.pack("invariant")
    assert picked_first.router.native_logits and not picked_first.router.native_route
    assert "not one of the walk's top-k rules" in stack_model._why_not_walked_moe(picked_first, "in_turn")
    stack = model.native_stack
    assert stack is not None and stack.shape.latent is not None
    assert not stack.serves(engine.runner.kv_caches, engine.runner.backend, None)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()


def test_steps_with_lora_adapters_match_the_module_path_bit_for_bit(model_dir: Path,
                                                                    adapters: list[LoRARequest | None]) -> None:
    run_both_paths(model_dir, adapters)


def run_split(model_dir: Path, monkeypatch: pytest.MonkeyPatch, kv_prefetch_bytes: int,
              loras: list[LoRARequest | None] | None = None) -> None:
    """run_both_paths with decode steps of two sequences on split (the default waits for
    32), over two threads whatever this machine has; some step must have been split."""
    monkeypatch.setattr(stack_model, "SPLIT_FROM_TOKENS", 2)
    monkeypatch.setattr(stack_model, "KV_PREFETCH_BYTES", kv_prefetch_bytes)
    splits: list[int] = []

    def recording(query_lens: list[int], seq_lens: list[int], threads: int) -> int:
        splits.append(split_point(query_lens, seq_lens, threads))
        return splits[-1]

    monkeypatch.setattr(stack_model, "split_point", recording)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run_both_paths(model_dir, loras)
    finally:
        torch.set_num_threads(threads)
    assert any(split > 0 for split in splits), "no step was split into two walks"


def test_two_concurrent_walks_match_the_module_path_bit_for_bit(model_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    run_split(model_dir, monkeypatch, 8 << 20)


# Split walks fetch each layer's KV ahead during their matmuls: none of it, a block's K
# and V of one layer (the budget cuts the stream short), and all of it (the test above).
@pytest.mark.parametrize("kv_prefetch_bytes", [0, 2 * 16 * 2 * 32 * 2])
def test_two_concurrent_walks_keep_the_bits_at_every_prefetch_budget(prefetch_model_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     kv_prefetch_bytes: int) -> None:
    run_split(prefetch_model_dir, monkeypatch, kv_prefetch_bytes)


def test_two_concurrent_walks_with_lora_adapters_match_the_module_path(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       adapters: list[LoRARequest | None]) -> None:
    run_split(model_dir, monkeypatch, 8 << 20, adapters)  # each walk its own adapter rows and scratch


def test_split_point_balances_decode_steps_and_leaves_the_rest_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stack_model, "ROW_COST_IN_CONTEXT_TOKENS", 600)
    decode = [1] * 40
    assert split_point(decode, [300] * 40, threads=2) == 20  # equal contexts: half the sequences each
    # Costs 10 x (600 + 1,800) = 24,000, then 30 x (600 + 100) = 21,000; half of 45,000 is
    # 22,500. The first 9 sequences cost 21,600 (the other walk 23,400), the first 10
    # 24,000 (21,000): 9 is the closer, and sequence 9 lies mostly past the midpoint.
    assert split_point(decode, [1800] * 10 + [100] * 30, threads=2) == 9
    # One walk: below the threshold, a step with a prompt in it, other thread counts.
    assert split_point([1] * (stack_model.SPLIT_FROM_TOKENS - 1), [300] * 31, threads=2) == 0
    assert split_point([1] * 39 + [5], [300] * 40, threads=2) == 0
    assert split_point(decode, [300] * 40, threads=1) == 0
    assert split_point(decode, [300] * 40, threads=4) == 0


def test_configurations_it_does_not_serve_run_the_modules(model_dir: Path) -> None:
    for kwargs in ({"dtype": "float32"}, {"dtype": "bfloat16", "matmul": "onednn"},
                   {"dtype": "bfloat16", "decoder_stack": "modules"}):
        engine = LLMEngine(EngineConfig.from_kwargs(str(model_dir), num_blocks=32, **kwargs))
        assert engine.model.native_stack is None, kwargs  # type: ignore[attr-defined]
    # Built, but a backend without the paired layout (the reference) is not the walk's.
    engine = LLMEngine(EngineConfig.from_kwargs(str(model_dir), dtype="bfloat16", num_blocks=32,
                                                attention_backend="torch_ref"))
    stack = engine.model.native_stack  # type: ignore[attr-defined]
    assert stack is not None
    assert not stack.serves(engine.runner.kv_caches, engine.runner.backend, None)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def test_bad_tensors_are_named_before_any_pointer_reaches_c(model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(str(model_dir), dtype="bfloat16", num_blocks=32))
    stack: Any = engine.model.native_stack  # type: ignore[attr-defined]
    tokens, caches = 3, engine.runner.kv_caches
    rows = decoder_stack.StackRows(torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                                   torch.tensor([0], dtype=torch.int32), torch.tensor([3], dtype=torch.int32))
    width = stack.shape.rotary_dim or stack.shape.head_dim  # the rotary tables' (Phi-4's part of a head)
    good: dict[str, Any] = dict(scratch=None, residual=torch.zeros(tokens, 128, dtype=torch.bfloat16), kv_caches=caches,
                cos=torch.ones(tokens, width), sin=torch.zeros(tokens, width), slots=torch.arange(tokens), rows=rows,
                local_rotary=local_tables(engine, tokens, width))
    local_cases = [] if good["local_rotary"] is None else [
        ("local_rotary", None, "local_rotary must be given: some layers turn by the local rotary table"),
        ("local_rotary", (torch.ones(tokens, width), torch.zeros(tokens + 1, width)),
         rf"local sin must be a contiguous \[3, {width}\] torch.float32")]
    for name, bad, message in (*local_cases,
            ("residual", torch.zeros(tokens, 128), r"residual must be a contiguous \[3, 128\] torch.bfloat16"),
            ("cos", torch.ones(tokens, width + 2), rf"cos must be a contiguous \[3, {width}\] torch.float32"),
            ("slots", torch.arange(tokens, dtype=torch.int32), "slots must be"),
            ("kv_caches", caches[:, :, :, :8], "kv_caches must be a contiguous"),
            ("scratch", torch.empty(decoder_stack.scratch_elements(stack.shape, tokens) - 1, dtype=torch.bfloat16),
             "scratch must be a contiguous 1-D bf16 tensor of at least")):
        with pytest.raises(ValueError, match=f"kvloom decoder_stack: {message}"):
            decoder_stack.run(stack.kernels, stack.weights, stack.shape, scale=0.1, **{**good, name: bad})


def test_split_walks_are_checked_and_a_refused_path_ends_both(model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(str(model_dir), dtype="bfloat16", num_blocks=32))
    stack: Any = engine.model.native_stack  # type: ignore[attr-defined]
    tokens, caches = 2, engine.runner.kv_caches
    rows = decoder_stack.StackRows(torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32),
                                   torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32))
    width = stack.shape.rotary_dim or stack.shape.head_dim
    args: dict[str, Any] = dict(residual=torch.zeros(tokens, 128, dtype=torch.bfloat16), kv_caches=caches,
                                cos=torch.ones(tokens, width), sin=torch.zeros(tokens, width),
                                slots=torch.tensor([2, 20]), rows=rows, scale=0.1,
                                local_rotary=local_tables(engine, tokens, width))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(ValueError, match="kv_prefetch_bytes must be >= 0, got -1"):
            decoder_stack.run(stack.kernels, stack.weights, stack.shape, split_seqs=1, kv_prefetch_bytes=-1, **args)
        for bad in (2, -1):  # the second walk would have no sequence / a negative start
            with pytest.raises(ValueError, match=rf"split_seqs must be 0, or within \(0, 2\) .* got {bad}"):
                decoder_stack.run(stack.kernels, stack.weights, stack.shape, split_seqs=bad, **args)
        torch.set_num_threads(3)
        with pytest.raises(ValueError, match=r"even thread count \(have 3\)"):
            decoder_stack.run(stack.kernels, stack.weights, stack.shape, split_seqs=1, **args)
        torch.set_num_threads(2)
        # A path this CPU lacks: both walks' first matmul refuses it, and the call returns
        # (a walk that stopped early leaves the other nothing to wait on).
        lacking = [isa for isa in gemm.ISAS if isa not in gemm.supported_isas()]
        if lacking:
            shape = dataclasses.replace(stack.shape, isa=lacking[-1])
            with pytest.raises(RuntimeError, match=f"layer 0's matmul refused the '{lacking[-1]}' path"):
                decoder_stack.run(stack.kernels, stack.weights, shape, split_seqs=1, **args)
    finally:
        torch.set_num_threads(threads)


def test_the_last_layer_for_some_rows_gives_those_rows_bits(model_dir: Path) -> None:
    """One call by hand, its sequences in an order no schedule above makes: a prompt chunk
    that samples nowhere first, then a decode, then a chunk read at its last two rows
    (a token and its draft), then another chunk read nowhere. The rows read, and their
    stream, must be those of the call that computes every row; so must the cache."""
    engine = LLMEngine(EngineConfig.from_kwargs(str(model_dir), dtype="bfloat16", num_blocks=32, block_size=16))
    stack: Any = engine.model.native_stack  # type: ignore[attr-defined]
    generator = torch.Generator().manual_seed(0)
    caches = torch.randn(engine.runner.kv_caches.shape, generator=generator).to(torch.bfloat16)
    query_lens, seq_lens = [5, 1, 4, 3], [5, 30, 20, 19]
    tokens = sum(query_lens)
    tables = torch.tensor([[0, 0], [1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    starts = [sum(query_lens[:s]) for s in range(4)]
    slots = torch.tensor([int(tables[s, p // 16]) * 16 + p % 16 for s in range(4)
                          for p in range(seq_lens[s] - query_lens[s], seq_lens[s])])
    rows = decoder_stack.StackRows(tables, torch.tensor(seq_lens, dtype=torch.int32),
                                   torch.tensor(starts, dtype=torch.int32), torch.tensor(query_lens, dtype=torch.int32))
    read = torch.tensor([5, 8, 9])  # the decode's row, and the third chunk's last two
    outputs = stack_model._stack_outputs(read, query_lens, rows)
    assert outputs.sequences.query_lens.tolist() == [1, 2] and outputs.sequences.seq_lens.tolist() == [30, 20]
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)])
    cos, sin = (part.float().contiguous() for part in engine.model.rotary.cos_sin(positions))  # type: ignore[attr-defined]
    local_rotary: Any = engine.model.local_rotary  # type: ignore[attr-defined]
    local = None if local_rotary is None else tuple(part.contiguous() for part in local_rotary.cos_sin(positions))
    softcap = engine.runner.backend.softcap  # Gemma 2's
    embeddings = torch.randn(tokens, 128, generator=generator).to(torch.bfloat16)
    results = []
    for kept in (None, outputs):
        residual, cache = embeddings.clone(), caches.clone()
        hidden = decoder_stack.run(stack.kernels, stack.weights, stack.shape, residual, cache, cos, sin, slots, rows,
                                   scale=0.1, outputs=kept, local_rotary=local, softcap=softcap)
        results.append((hidden, residual, cache))
    (every_hidden, every_residual, every_cache), (hidden, residual, cache) = results
    assert hidden.shape == (3, 128)
    assert torch.equal(hidden, every_hidden[read]) and torch.equal(residual[:3], every_residual[read])
    assert torch.equal(cache, every_cache)
    # Rows that are not the last of their sequence's query cannot be asked for alone.
    with pytest.raises(ValueError, match=r"output rows \[6\] are not the last rows"):
        stack_model._stack_outputs(torch.tensor([6]), query_lens, rows)
    with pytest.raises(ValueError, match="outputs.rows must be ascending"):
        decoder_stack.run(stack.kernels, stack.weights, stack.shape, embeddings.clone(), caches.clone(), cos, sin,
                          slots, rows, scale=0.1, outputs=dataclasses.replace(outputs, rows=torch.tensor([8, 5, 9])),
                          local_rotary=local)
