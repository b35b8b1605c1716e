"""The decoder layers of a LlamaForCausalLM (and of the families built on it whose layers
are Llama's but for their norms, MLP and where the norms sit: Gemma 1-3, Helium, OLMo 2
and 3, EXAONE 4, StarCoder2, GPT-2, Phi, GPT-NeoX; and of the hybrids whose other layers
keep a state per request, each followed by Llama's MLP: Bamba's and IBM Granite 4.0's Mamba2
mixers, LiquidAI LFM2's gated short convolutions; and of the mixture-of-experts models whose
router is kvloom::moe_route's and whose experts are SwiGLU without biases, beside a shared expert
or not: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GraniteMoE, Granite 4.0's and LFM2-MoE's hybrids) in
one native call (kernels/decoder_stack.py).

``NativeDecoderStack.build(model)`` reads the packed model once: a table of its
weights' data pointers (the tensors stay owned by the model's modules, which outlive
the table) and the shapes; ``None``, with the reason, where the model is not one the
walk serves (not bf16 on CPU with kvloom's GEMM in every layer). Per forward,
``serves`` asks whether this step's cache and attention backend are the walk's (the
CPU paged backend with its paired layout); otherwise the module path runs. Both paths
call the same kernels in the same order, so their results are bit-identical
(tests/models/test_decoder_stack.py); the module path stays the readable reference
and what every other configuration runs. LoRA adapters run in the walk too once their
table is set (``set_lora``, by kvloom/lora on each load). A profiler sees the walk as one call:
``--decoder-stack modules`` shows the kernels one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import nn

from kvloom.attention.base import AttentionBackend
from kvloom.attention.cpu_paged import CPUPagedBackend, CPUPagedMetadata, KernelRows
from kvloom.batch import ForwardBatch
from kvloom.config import ModelConfig
from kvloom.distributed.group import TensorParallelGroup
from kvloom.kernels import decoder_stack as kernels
from kvloom.kernels import latent_attention
from kvloom.models.layers import (
    Float32ScaledRMSNorm,
    GatedMLP,
    ResidualLayerNorm,
    RMSNorm,
    UngatedMLP,
    UnweightedLayerNorm,
)
from kvloom.models.mamba2 import Mamba2Mixer
from kvloom.models.moe import SparseMoE, native_groups
from kvloom.models.packed_linear import InvariantLinear
from kvloom.models.short_conv import ShortConv
from kvloom.models.ssm_ops import SSMSpans

WEIGHT_ROPE = kernels.WEIGHT_COLUMNS.index("rope")
WEIGHT_MIXER = kernels.WEIGHT_COLUMNS.index("mixer")
StateLayer = Mamba2Mixer | ShortConv  # the layers the walk runs that keep a state per request
COLUMN_CONV_STATE = kernels.WEIGHT_COLUMNS.index("conv_state")
COLUMN_SSM_STATE = kernels.WEIGHT_COLUMNS.index("ssm_state")

# Two concurrent walks (csrc/decoder_stack.cpp) from this many tokens a step: below it
# the step is bound by reading the weights, which each walk reads for itself (decode,
# context 300, AMD EPYC model 17, one process alternating: batch 32 33.2 -> 31.9 ms
# split, 64 63.7 -> 62.0, 128 126.8 -> 116.3; batch 16 17.6 -> 20.1, and 26.3 -> 28.8
# at context 1,000; docs/results/issue17/genoa7/two_walks.txt).
SPLIT_FROM_TOKENS = 32
# A row's matmuls cost about what reading this many tokens of its KV costs (decode at
# context 300 on AMD EPYC model 17: ~0.5 ms a row against ~0.86 us a context token),
# the unit in which the two walks are balanced.
ROW_COST_IN_CONTEXT_TOKENS = 600


# Of each layer's KV, what a walk fetches into cache during the matmuls before its
# attention, where the step splits into two walks (each walk's matmuls then run on one
# core and leave memory bandwidth spare; csrc/decoder_stack.cpp has the measurements).
# Decode at batch 128 and context 300 (15 MB of a layer's KV a walk) gained as much
# from 8 as from 16 MiB, and less from 4.
KV_PREFETCH_BYTES = 8 << 20


def split_point(query_lens: list[int], seq_lens: list[int], threads: int) -> int:
    """Where the second of two walks should begin (its first sequence), or 0 for one walk.

    Only decode steps split (every sequence one token): prompt steps ran 2-4% slower split,
    as one walk's long prompt leaves the other waiting. The halves are balanced on each
    sequence's estimated cost (its row's matmuls and its KV read), and only two threads
    split: with more, each walk would still read the weights for itself, unmeasured."""
    tokens = len(query_lens)
    if threads != 2 or tokens < SPLIT_FROM_TOKENS or any(length != 1 for length in query_lens):
        return 0
    costs = [ROW_COST_IN_CONTEXT_TOKENS + length for length in seq_lens]
    half, total = sum(costs) / 2, 0.0
    for index, cost in enumerate(costs):
        if total + cost / 2 >= half:  # sequence `index` lies mostly past the midpoint
            return max(1, index)
        total += cost
    return tokens - 1


class DecoderModel(Protocol):
    """What the walk reads of a model (LlamaForCausalLM is one): its config, its
    tensor-parallel group and its layers, each with input_layernorm (none in OLMo 2's),
    self_attn (qkv_proj, o_proj, this rank's num_heads and num_kv_heads, q_norm and k_norm
    where config.qk_norm or OLMo 2's), post_attention_layernorm, mlp (a GatedMLP: gate_up_proj,
    down_proj, this rank's intermediate_size, its activation; or an UngatedMLP: fc1, fc2), local_rope (whether the layer
    turns by the local rotary table) and, for Gemma 2 and 3, pre_feedforward_layernorm, for
    them and OLMo 2, post_feedforward_layernorm. A hybrid's layers (Bamba's: a ``kind``,
    "attention", "mamba" or "conv") hold self_attn, mamba (a Mamba2Mixer) or conv (LFM2's
    ShortConv), pre_ff_layernorm and
    feed_forward in place of post_attention_layernorm and mlp, and the model its attention
    layers' ranks in the KV pool (``kv_layer``) and its rotary's width (``rotary_dim``). A model
    whose blocks are not layers (Nemotron-H's) pairs them as ``walk_layers()`` (WalkLayer). A
    DeepSeek layer's self_attn is a latent attention (models/deepseek.py's LatentAttention, known
    by its ``mla``: q_proj, or q_a_proj, q_a_layernorm and q_b_proj; kv_a_proj_with_mqa,
    kv_a_layernorm, its heads' packed up-projections ``grouped``, o_proj)."""

    config: ModelConfig
    tp: TensorParallelGroup
    layers: nn.ModuleList


@dataclass(frozen=True)
class WalkLayer:
    """A walk layer made of a model's blocks (NVIDIA Nemotron-H's single-mixer blocks,
    ``walk_layers``): a mixer or attention block (``kind`` "mamba" or "attention", its norm
    ``input_layernorm``) and the MLP block after it (``feed_forward``, its norm
    ``pre_ff_layernorm``; None: none follows), or an MLP block alone (``kind`` "none").
    ``kv_layer``: an attention block's layer of the KV pool; ``no_rope``: its attention turns
    no rotary."""

    kind: str
    input_layernorm: nn.Module | None
    self_attn: nn.Module | None
    mamba: Mamba2Mixer | None
    pre_ff_layernorm: nn.Module | None
    feed_forward: nn.Module | None
    kv_layer: int = 0
    no_rope: bool = True
    conv: ShortConv | None = None


class NativeDecoderStack:
    def __init__(self, weights: torch.Tensor, owners: list[torch.Tensor], shape: kernels.StackShape,
                 tp: TensorParallelGroup) -> None:
        self.weights = weights  # [layers, len(WEIGHT_COLUMNS)] int64 data pointers
        self._owners = owners  # the tensors behind those pointers: alive as long as the table
        self.shape = shape
        # Tensor parallel: the walk all-reduces through the group's shared memory, with
        # the same function (and collective numbers) as the module path's all-reduces.
        self.tp = tp
        self.kernels = kernels.kernel_table(all_reduce=tp.size > 1)
        # Reused by every forward, grown to the largest step's rows: a 2,048-token
        # prefill needs 30 MB for the default model, which a fresh allocation would
        # fault in page by page on every step.
        self._scratch = torch.empty(0, dtype=torch.bfloat16)
        # LoRA adapters' weights (kvloom/lora/native.py), None where none are loaded or they
        # cannot run here; LoRA's own scratch, grown as _scratch is.
        self.lora: kernels.StackLoRA | None = None
        self._lora_scratch = torch.empty(0, dtype=torch.bfloat16)
        # A hybrid's state layers (Mamba2 mixers, short convolutions) by layer: their state
        # tensors are allocated after the walk is built, so their pointers enter the table at
        # the first step (_bind_states).
        self.state_layers: dict[int, StateLayer] = {}
        self._bound_states: tuple[int, ...] = ()

    def set_lora(self, lora: kernels.StackLoRA | None) -> None:
        """The adapters' table the walk reads from now on (None: steps with adapter rows
        take the module path; kvloom/lora hands None while an adapter on an expert layer's
        MLP, routed or shared experts, is loaded, whose deltas the walk does not add)."""
        self.lora = lora

    @classmethod
    def build(cls, model: DecoderModel) -> tuple[NativeDecoderStack | None, str]:
        """The walk over ``model``'s layers, or None and why it cannot serve them."""
        if not kernels.available():
            return None, "kvloom/csrc/decoder_stack.cpp or a kernel it calls does not build here"
        if model.tp.size > 1 and model.tp.shm is None:
            return None, ("tensor parallel over torch.distributed (ranks on several hosts, or "
                          "--no-shared-memory): the walk all-reduces only through shared memory")
        config = model.config
        if config.attention_sinks:
            return None, "its layers' attention has sinks (GPT-OSS's), which the walk's kernel does not take"
        moe_shapes: set[kernels.MoEShape] = set()
        latent_shapes: set[kernels.LatentShape] = set()
        widths: set[int] = set()  # every MLP's (shared experts' too) features, negative where un-gated
        rows: list[list[int]] = []
        owners: list[torch.Tensor] = []
        isas: set[str] = set()
        # (norm, its offset, q/k norms whole, parallel) of every layer; the MLPs' activations
        kinds: set[tuple[str, float, bool, str]] = set()
        epsilons: set[float] = set()
        state_layers: dict[int, StateLayer] = {}
        activations: set[str] = set()
        # The walk's layers: the model's, or its blocks paired as layers (Nemotron-H's walk_layers).
        layers: list[Any] = model.walk_layers() if hasattr(model, "walk_layers") else list(model.layers)
        for index, layer in enumerate(layers):
            hybrid = hasattr(layer, "kind")  # a hybrid's layer (Bamba's, a WalkLayer) names its block
            kind = layer.kind if hybrid else "attention"
            if kind not in kernels.MIXERS:
                return None, f"layer {index} is a {kind!r} layer, which the walk does not run"
            attention = layer.self_attn if kind == "attention" else None
            latent = getattr(attention, "mla", None) is not None  # DeepSeek's latent attention
            if latent:
                why_not = _why_not_walked_latent(attention)
                if why_not:
                    return None, f"layer {index}'s latent attention {why_not}"
                latent_shapes.add(_latent_shape(attention))
                isas.add(attention.grouped.isa)
            mlp = layer.feed_forward if hybrid else layer.mlp  # None: a layer without one (Nemotron-H's)
            if kind in ("mamba", "conv"):
                state_layer = layer.mamba if kind == "mamba" else layer.conv
                why_not = _why_not_walked(state_layer, config.hidden_size)
                if why_not:
                    return None, f"layer {index}'s {type(state_layer).__name__} {why_not}"
                state_layers[index] = state_layer
            # Phi's, GPT-NeoX's and StableLM's: attention and MLP side by side (Phi's and StableLM's
            # MLP reads the attention's input), added in the order the layer names.
            parallel = (getattr(layer, "parallel_adds", "blocks_first") if getattr(layer, "parallel", False)
                        else "in_turn")
            post_norm = layer.pre_ff_layernorm if hybrid else getattr(layer, "post_attention_layernorm", None)
            if parallel != "in_turn" and model.tp.size > 1:
                return None, f"layer {index} adds attention and MLP side by side, which the walk runs in one process"
            if post_norm is None and parallel == "in_turn" and mlp is not None:
                return None, f"layer {index} has no norm before its MLP"
            experts: SparseMoE | None = None
            if isinstance(mlp, SparseMoE):
                why_not = _why_not_walked_moe(mlp, parallel)
                if why_not:
                    return None, f"layer {index}'s mixture-of-experts FFN {why_not}"
                experts, mlp = mlp, mlp.shared_expert  # the walk's dense MLP: its shared expert, if any
                moe_shapes.add(_moe_shape(experts))
                isas.add(experts.grouped.isa)  # type: ignore[union-attr]
                if not experts.router.native_logits:
                    isas.add(experts.router.packed.isa)  # type: ignore[union-attr]
            if mlp is not None:  # each MLP's width (a shared expert's too), its kind's sign: gated +, un-gated -
                widths.add(mlp.intermediate_size if isinstance(mlp, GatedMLP) else -mlp.intermediate_size)
            if mlp is None:
                up = down = None
            elif isinstance(mlp, UngatedMLP):
                activations.add(f"{mlp.form}_plain")
                up, down = mlp.fc1, mlp.fc2
            elif isinstance(mlp, GatedMLP) and mlp.activation in ("silu", "gelu_tanh"):
                activations.add(mlp.activation)
                up, down = mlp.gate_up_proj, mlp.down_proj
            else:
                return None, f"layer {index}'s MLP is not the walk's (gated SiLU or GELU-tanh, or un-gated GELU)"
            block = ((attention.q_proj or attention.q_b_proj, attention.o_proj) if latent
                     else (attention.qkv_proj, attention.o_proj) if attention is not None
                     else (state_layers[index].in_proj, state_layers[index].out_proj) if index in state_layers
                     else (None, None))
            projections = dict(zip(("qkv", "o", "gate_up", "down"), (*block, up, down), strict=True))
            if latent:  # the latent's projection and, where the query is low-rank, its first one
                projections.update(q_a=getattr(attention, "q_a_proj", None), kv_a=attention.kv_a_proj_with_mqa)
            linears = tuple(linear for linear in projections.values() if linear is not None)
            if not all(isinstance(linear, InvariantLinear) for linear in linears):
                return None, f"layer {index} has matmuls other than kvloom's GEMM (--matmul invariant, bf16, CPU)"
            # Qwen3's, Gemma 3's and EXAONE 4's of a head, OLMo 2's of the whole projection
            head_norms = ((attention.q_norm, attention.k_norm)
                          if attention is not None and not latent and attention.q_norm is not None else ())
            whole = bool(head_norms) and head_norms[0].weight.shape[0] != config.head_dim
            if whole and model.tp.size > 1:
                return None, (f"layer {index}'s q/k norms span every head, whose statistics the walk does not "
                              "gather from the ranks")
            if whole and (head_norms[0].weight.shape[0] != attention.q_size
                          or head_norms[1].weight.shape[0] != attention.kv_size):
                return None, f"layer {index}'s q/k norms span neither a head nor the whole projection"
            pre_ff, post_ff = (getattr(layer, name, None) for name in ("pre_feedforward_layernorm",
                                                                       "post_feedforward_layernorm"))
            input_norm = getattr(layer, "input_layernorm", None)  # None: OLMo 2's norms after each block
            llama = (input_norm is not None or kind == "none") and pre_ff is None and post_ff is None
            gemma = input_norm is not None and pre_ff is not None and post_ff is not None
            olmo = input_norm is None and pre_ff is None and post_ff is not None
            if not (llama or gemma or olmo) or (parallel != "in_turn" and not llama):
                return None, f"layer {index}'s norms sit neither as Llama's, Gemma 2's nor OLMo 2's"
            block_norms = tuple(norm for norm in (pre_ff, post_ff) if norm is not None)
            norms = (*(() if input_norm is None else (input_norm,)), *(() if post_norm is None else (post_norm,)),
                     *head_norms, *block_norms)
            tensors = [tensor for norm in norms for tensor in (norm.weight, getattr(norm, "bias", None))
                       if tensor is not None]
            if any(tensor.dtype != torch.bfloat16 or tensor.device.type != "cpu" or not tensor.is_contiguous()
                   for tensor in tensors) or any(norm.eps != norms[0].eps for norm in norms):
                return None, f"layer {index}'s norms are not contiguous bf16 CPU weights with one eps"
            epsilons.add(norms[0].eps)
            norm_kinds = {_norm_kind(norm) for norm in norms}
            if None in norm_kinds or len(norm_kinds) != 1:
                return None, (f"layer {index}'s norms are not one kind the walk runs (Llama's RMSNorm, one scaled in "
                              "float32, or LayerNorm with a bias)")
            if ("layer", 0.0) in norm_kinds and (head_norms or block_norms):
                return None, f"layer {index} has LayerNorms of heads or blocks, which the walk does not run"
            kinds.add((*norm_kinds.pop(), whole, parallel))  # type: ignore[misc]
            isas.update(linear.isa for linear in linears)
            no_rope = getattr(layer, "no_rope", index in config.no_rope_layers)  # a WalkLayer says it
            rope = ("none" if no_rope or attention is None
                    else "local" if getattr(layer, "local_rope", False) else "global")
            kv_layer = getattr(layer, "kv_layer", None)
            if kv_layer is None:
                kv_layer = model.kv_layer.get(index, 0) if hybrid else index
            biases = {name: norm.bias.data_ptr() for name, norm in (("input_norm_bias", input_norm),
                                                                    ("post_norm_bias", post_norm))
                      if isinstance(norm, (ResidualLayerNorm, UnweightedLayerNorm))}
            row: dict[str, int] = {"input_norm": 0 if input_norm is None else input_norm.weight.data_ptr(),
                                   "input_norm_bias": 0, "post_norm_bias": 0, **biases,
                                   "post_norm": 0 if post_norm is None else post_norm.weight.data_ptr(),
                                   "q_norm": 0, "k_norm": 0, "window": getattr(attention, "window", 0),
                                   "rope": kernels.ROPE[rope], "mixer": kernels.MIXERS["latent" if latent else kind],
                                   "kv_layer": kv_layer,
                                   **_state_columns(state_layers.get(index), owners),
                                   "pre_ff_norm": 0 if pre_ff is None else pre_ff.weight.data_ptr(),
                                   "post_ff_norm": 0 if post_ff is None else post_ff.weight.data_ptr()}
            if head_norms:
                row["q_norm"], row["k_norm"] = (norm.weight.data_ptr() for norm in head_norms)
            owners += tensors
            for name, linear in projections.items():  # 0 where the layer has no such matmul
                row[name] = 0 if linear is None else linear.packed_weight.data_ptr()
                row[f"{name}_bias"] = 0 if linear is None or linear.bias is None else linear.bias.data_ptr()
                if linear is not None:
                    owners += [linear.packed_weight] + ([] if linear.bias is None else [linear.bias])
            row.update(router=0, experts_gate_up=0, experts_down=0, router_bias=0, shared_gate=0,
                       mlp_width=mlp.intermediate_size if isinstance(mlp, (GatedMLP, UngatedMLP)) else 0,
                       **_latent_columns(attention if latent else None, owners))
            if experts is not None:  # _why_not_walked_moe checked these
                grouped, router = experts.grouped, experts.router.packed
                assert grouped is not None
                # A float32 router's weight as it is (kvloom::router_logits'), else its packed bf16 one.
                router_weight = (experts.router.weight if experts.router.native_logits
                                 else cast(InvariantLinear, router).packed_weight)
                row.update(router=router_weight.data_ptr(), experts_gate_up=grouped.gate_up.data_ptr(),
                           experts_down=grouped.down.data_ptr())
                owners += [router_weight, grouped.gate_up, grouped.down]
                if experts.packed_shared_gate is not None:  # _why_not_walked_moe: kvloom's GEMM
                    gate = experts.packed_shared_gate
                    assert isinstance(gate, InvariantLinear)
                    row["shared_gate"] = gate.packed_weight.data_ptr()
                    owners.append(gate.packed_weight)
                selection = experts.router.score_correction_bias  # float32, contiguous (a parameter)
                if selection is not None:
                    row["router_bias"] = selection.data_ptr()
                    owners.append(selection)
            rows.append([row[column] for column in kernels.WEIGHT_COLUMNS])
        if len(isas) != 1:
            return None, f"the layers' matmuls run on different GEMM paths {sorted(isas)}"
        if not activations:  # every MLP a mixture of experts (their SwiGLU is the walk's own)
            activations.add("silu")
        if min(widths, default=0) < 0 < max(widths, default=0):
            return None, f"it has gated and un-gated MLPs {sorted(widths)}"
        if latent_shapes and (len(latent_shapes) > 1 or any(row[WEIGHT_MIXER] != kernels.MIXERS["latent"]
                                                             for row in rows)):
            return None, "its layers' attention is not one latent attention in every layer"
        if len(moe_shapes) > 1:
            return None, f"its mixture-of-experts layers differ {sorted(map(str, moe_shapes))}"
        if len(kinds) != 1 or len(epsilons) != 1 or len(activations) != 1:
            return None, (f"the layers' norms and MLPs differ {sorted(kinds)} (eps {sorted(epsilons)}, activations "
                          f"{sorted(activations)})")
        (norm, norm_offset, qk_norm_whole, parallel), = kinds
        activation = activations.pop()
        attending = [layer for layer in layers if getattr(layer, "kind", "attention") == "attention"]
        if not attending:
            return None, "it has no attention layer"
        # this rank's share of the heads and features (all of them without TP)
        first = attending[0].self_attn
        latent_shape = latent_shapes.pop() if latent_shapes else None
        heads = (0, 0, 0) if latent_shape else (first.num_heads, first.num_kv_heads, config.head_dim)
        residual_scale = config.scales.residual if config.scales is not None else 1.0  # Granite's
        features = [abs(width) for width in widths]  # the widest is the scratch's
        shape = kernels.StackShape(len(rows), config.hidden_size, *heads,
                                   max(features, default=config.intermediate_size),
                                   epsilons.pop(), isas.pop(), residual_scale,
                                   latent_shape.rope if latent_shape else (getattr(model, "rotary_dim", None)
                                                                           or config.rotary_dim),
                                   norm, norm_offset, activation, qk_norm_whole, parallel,
                                   config.clip_qkv or 0.0,
                                   any(row[WEIGHT_ROPE] == kernels.ROPE["local"] for row in rows),
                                   len(attending) if state_layers else None,
                                   _state_shape(config) if state_layers else None,
                                   moe_shapes.pop() if moe_shapes else None, latent_shape)
        stack = cls(torch.tensor(rows, dtype=torch.int64), owners, shape, model.tp)
        stack.state_layers = state_layers
        return stack, ""

    def serves(self, kv_caches: torch.Tensor, backend: AttentionBackend[Any], metadata: Any,
               with_lora: bool = False) -> bool:
        """Whether this forward's cache and attention are the walk's (never while
        torch.compile traces: the walk is opaque to it, the modules' ops are not), and
        with adapter rows (``with_lora``) whether it holds the adapters' table."""
        if torch.compiler.is_compiling() or (with_lora and self.lora is None) or kv_caches.dtype != torch.bfloat16:
            return False
        if self.shape.latent is not None:  # the latent kernel's backend (mla_cpu), its products this process's
            return (backend.name == "mla_cpu" and isinstance(metadata, KernelRows)
                    and self.shape.latent.products == latent_attention.default_products())
        return (all(_native_kernel(layer) for layer in self.state_layers.values())
                and isinstance(backend, CPUPagedBackend)
                and isinstance(metadata, CPUPagedMetadata) and backend.paired_layout(kv_caches[0]))

    def __call__(self, residual: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                 kv_caches: torch.Tensor, backend: AttentionBackend[Any], metadata: CPUPagedMetadata | KernelRows,
                 local_rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                 spans: SSMSpans | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over ``residual`` (the embeddings, [tokens, hidden], updated in
        place); returns the last layer's output and the stream it is to be added to (the
        final norm adds it in), of the rows ``batch.output_rows`` names where it names
        some. Those rows alone take the last layer's attention and MLP, where one walk
        runs without tensor parallel (else every row does, and the rows are picked after).
        ``local_rotary``: the table of the layers that turn by their own (Gemma 3's).
        ``spans``: a hybrid's requests as its state layers read them (their states move on)."""
        rows = metadata.every if isinstance(metadata, CPUPagedMetadata) else metadata  # mla_cpu's: KernelRows
        stack_spans = None
        if self.state_layers:
            if spans is None:
                raise ValueError("a hybrid's walk needs the step's SSMSpans")
            stack_spans = kernels.StackSpans(spans.starts_tensor, spans.lengths_tensor, spans.slots,
                                             spans.has_state_int, self._bind_states())
        cos, sin = rotary
        needed = kernels.scratch_elements(self.shape, residual.shape[0])
        if self._scratch.numel() < needed:
            self._scratch = torch.empty(needed, dtype=torch.bfloat16)
        shm = self.tp.shm if self.tp.size > 1 else None
        before = shm.native_counts() if shm is not None else (0, 0, 0.0)
        split = (split_point(batch.query_lens_list, batch.seq_lens_list, torch.get_num_threads())
                 if shm is None else 0)
        outputs = (_stack_outputs(batch.output_rows, batch.query_lens_list, rows)
                   if batch.output_rows is not None and not split and shm is None else None)
        lora = self.lora if batch.lora_slots is not None else None
        lora_rows = None
        if lora is not None:  # each row's adapter slot (-1: the base model)
            assert batch.lora_slots is not None
            lora_rows = torch.repeat_interleave(torch.tensor(batch.lora_slots, dtype=torch.int32),
                                                torch.tensor(batch.query_lens_list))
            lora_needed = kernels.lora_scratch_elements(self.shape, residual.shape[0], lora)
            if self._lora_scratch.numel() < lora_needed:
                self._lora_scratch = torch.empty(lora_needed, dtype=torch.bfloat16)
        hidden = kernels.run(self.kernels, self.weights, self.shape, residual, kv_caches, cos, sin,
                             batch.slot_mapping,  # int64 from ForwardBatch.build (run checks it)
                             kernels.StackRows(rows.block_tables, rows.seq_lens, rows.query_start, rows.query_lens),
                             backend.scale, self._scratch, None if shm is None else shm.context, split,
                             KV_PREFETCH_BYTES if split else 0, outputs, lora, lora_rows, self._lora_scratch,
                             local_rotary, backend.softcap, stack_spans)
        if shm is not None:  # the walk's all-reduces count with the group's
            calls, sent, seconds = (now - then for now, then in zip(shm.native_counts(), before, strict=True))
            self.tp.stats.add_counts(int(calls), int(sent), seconds)
        if outputs is not None:
            return hidden, residual[:hidden.shape[0]]
        return batch.final_states(hidden), batch.final_states(residual)


    def _bind_states(self) -> int:
        """The state layers' state tensors' pointers in the weight table (they are allocated
        after the walk is built; bound again if allocated anew); returns their slots."""
        layers = list(self.state_layers.items())
        states = [(index, layer.conv_state, layer.ssm_state if isinstance(layer, Mamba2Mixer) else None)
                  for index, layer in layers]
        pointers = tuple(0 if tensor is None else tensor.data_ptr()
                         for _, conv, ssm in states for tensor in (conv, ssm))
        if pointers != self._bound_states:
            slots = {conv.shape[0] for _, conv, _ in states}
            for index, conv, ssm in states:
                if not conv.numel():
                    raise RuntimeError("a state layer runs only after allocate_state gave it its state slots")
                if (conv.dtype != torch.bfloat16 or not conv.is_contiguous() or len(slots) != 1 or ssm is not None
                        and (ssm.dtype != torch.float32 or not ssm.is_contiguous() or ssm.shape[0] != conv.shape[0])):
                    raise ValueError(f"layer {index}'s state must be a contiguous bf16 conv_state (and float32 "
                                     f"ssm_state) of the stack's one slot count, got {conv.dtype} {list(conv.shape)}"
                                     + ("" if ssm is None else f" and {ssm.dtype} {list(ssm.shape)}"))
                self.weights[index, COLUMN_CONV_STATE] = conv.data_ptr()
                self.weights[index, COLUMN_SSM_STATE] = 0 if ssm is None else ssm.data_ptr()
            self._bound_states = pointers
        return int(layers[0][1].conv_state.shape[0])


def _why_not_walked_moe(mlp: SparseMoE, parallel: str) -> str:
    """Why the walk cannot run the mixture-of-experts FFN ``mlp`` ("" where it can: experts
    packed for the grouped GEMM, a packed bf16 router, or a float32 one by kvloom::router_logits
    (DeepSeek's), whose rule is kvloom::moe_route's, SwiGLU experts without biases, a shared
    expert (gated by a sigmoid or not) or none, no expert adapters, in turn after the attention)."""
    moe, router = mlp.moe, mlp.router
    bf16_router = isinstance(router.packed, InvariantLinear) and router.packed.bias is None
    if mlp.grouped is None or not (bf16_router or router.native_logits):
        return "is not packed for kvloom's GEMM (bf16, --matmul invariant)"
    if not mlp.router.native_route:
        return (f"routes by {moe.scoring} scores and {moe.topk_method} choice, not one of the walk's top-k rules "
                "(a softmax's or sigmoid scores', steered by a bias or not, within the best groups or not)")
    if moe.hidden_act != ("silu" if moe.gated else "relu2") or moe.expert_biases:
        return "has experts other than the walk's (SwiGLU, or up alone through ReLU squared, without biases)"
    if mlp.shared_expert_gate is not None and not isinstance(mlp.packed_shared_gate, InvariantLinear):
        return "has a shared expert's gate not packed for kvloom's GEMM"
    if mlp.adapters is not None:
        return "has LoRA adapters on its experts, which run as modules"
    if parallel != "in_turn":
        return "runs beside the attention, which the walk's experts do not"
    return ""


def _why_not_walked_latent(attention: Any) -> str:
    """Why the walk cannot run the latent attention ``attention`` ("" where it can: kvloom's GEMM
    without biases in every projection, its heads' up-projections packed, bf16 norms,
    latent_attention.cpp built; under tensor parallel its rank's heads, o_proj's partial sums
    all-reduced)."""
    if not kernels.latent_available():
        return "needs kvloom/csrc/latent_attention.cpp, which does not build here"
    linears = [getattr(attention, name, None) for name in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                           "o_proj")]
    if attention.grouped is None or not all(isinstance(linear, InvariantLinear) and linear.bias is None
                                            for linear in linears if linear is not None):
        return "is not packed for kvloom's GEMM without biases (bf16, --matmul invariant)"
    norms = [attention.kv_a_layernorm, *([attention.q_a_layernorm] if attention.q_proj is None else [])]
    if any(type(norm) is not RMSNorm or norm.weight.dtype != torch.bfloat16 or norm.eps != norms[0].eps
           for norm in norms):
        return "has norms other than bf16 RMSNorms of one eps"
    return ""


def _latent_shape(attention: Any) -> kernels.LatentShape:
    mla, grouped = attention.mla, attention.grouped
    return kernels.LatentShape(attention.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim,
                               mla.v_head_dim, mla.q_lora_rank or 0, mla.rope_interleave,
                               latent_attention.default_products(), grouped.keys.stride(0), grouped.values.stride(0),
                               attention.kv_a_layernorm.eps)


def _latent_columns(attention: Any | None, owners: list[torch.Tensor]) -> dict[str, int]:
    """A latent-attention layer's norms and its heads' up-projections in the weight table
    (its q_a and kv_a projections are the layer's matmuls, written with the others); for any
    other layer zeros in all six columns. _why_not_walked_latent checked them."""
    columns = dict.fromkeys(("q_a_norm", "kv_a_norm", "heads_uk", "heads_uv"), 0)
    if attention is None:
        return {**columns, "q_a": 0, "kv_a": 0}
    tensors = {"kv_a_norm": attention.kv_a_layernorm.weight, "heads_uk": attention.grouped.keys,
               "heads_uv": attention.grouped.values}
    if attention.q_proj is None:
        tensors["q_a_norm"] = attention.q_a_layernorm.weight
    owners += tensors.values()
    return {**columns, **{name: tensor.data_ptr() for name, tensor in tensors.items()}}


def _moe_shape(mlp: SparseMoE) -> kernels.MoEShape:
    grouped, moe = mlp.grouped, mlp.moe
    assert grouped is not None
    sigmoid = moe.scoring == "sigmoid"
    groups = native_groups(moe) or (1, 1, "none")
    return kernels.MoEShape(moe.num_experts, moe.top_k, mlp.intermediate_size, grouped.gate_up.stride(0),
                            grouped.down.stride(0), moe.norm_topk_prob, moe.round_routing_weights,
                            moe.routed_scaling_factor, sigmoid, moe.norm_topk_eps if sigmoid else 0.0,
                            mlp.router.native_logits, *groups, moe.gated, mlp.first_expert, mlp.num_local_experts)


def _stack_outputs(output_rows: torch.Tensor, query_lens: list[int],
                   rows: kernels.StackRows) -> kernels.StackOutputs:
    """The walk's view of the rows a step reads: each is one of the last rows of its
    sequence's query (the sampled rows are the last known token and its drafts), so a
    sequence asks the last layer's attention for its last ``count`` rows."""
    counts: list[int] = []
    kept = output_rows.tolist()
    index, end = 0, 0
    for length in query_lens:
        end += length
        count = 0
        while index < len(kept) and kept[index] < end:
            index, count = index + 1, count + 1
        if kept[index - count:index] != list(range(end - count, end)):
            raise ValueError(f"output rows {kept[index - count:index]} are not the last rows of their sequence's "
                             f"query (tokens {end - length} to {end - 1})")
        counts.append(count)
    owners = torch.tensor([s for s, count in enumerate(counts) if count], dtype=torch.int64)
    lens = [count for count in counts if count]
    starts = [0]
    for count in lens[:-1]:
        starts.append(starts[-1] + count)
    return kernels.StackOutputs(output_rows, kernels.StackRows(
        rows.block_tables.index_select(0, owners), rows.seq_lens.index_select(0, owners),
        torch.tensor(starts[:len(lens)], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)))


def _norm_kind(norm: nn.Module) -> tuple[str, float] | None:
    """How ``norm`` scales, as StackShape's (norm, norm_offset); None: not a norm the walk runs."""
    if type(norm) is RMSNorm:
        return "llama", 0.0
    if type(norm) in (ResidualLayerNorm, UnweightedLayerNorm):  # OLMo 1's: weight 1, bias 0
        return "layer", 0.0
    if isinstance(norm, Float32ScaledRMSNorm) and type(norm).forward is Float32ScaledRMSNorm.forward:
        return "scaled_in_float32", norm.offset
    return None


def _native_kernel(layer: StateLayer) -> bool:
    """Whether ``layer`` runs its native kernel (the walk's) rather than its reference."""
    return (layer.prefill_scan if isinstance(layer, Mamba2Mixer) else layer.kernel) == "native"


def _why_not_walked(layer: StateLayer, hidden_size: int) -> str:
    """Why the walk cannot run the state layer ``layer`` ("" where it can: its float32
    parameters packed in a bf16 model, sizes within kvloom/csrc/ssm.cpp's)."""
    from kvloom.kernels import ssm

    if not kernels.mixers_available():
        return "needs kvloom/csrc/ssm.cpp, which does not build here"
    if isinstance(layer, ShortConv):
        conv = layer.packed_conv
        if conv is None or layer.conv.weight.dtype != torch.bfloat16:
            return "is not packed in bf16 (pack_weights)"
        taps, channels = conv.weight_t.shape
        if channels != hidden_size or taps > ssm.MAX_CONV_KERNEL:
            return f"has a convolution of {taps} taps x {channels} channels, not the kernel's"
        return ""
    sizes = layer.ssm
    if sizes.head_dim > ssm.MAX_HEAD_DIM or sizes.state_size > ssm.MAX_STATE or sizes.conv_kernel > ssm.MAX_CONV_KERNEL:
        return (f"has head_dim {sizes.head_dim}, d_state {sizes.state_size} and a kernel of {sizes.conv_kernel}, "
                f"past the kernel's {ssm.MAX_HEAD_DIM}, {ssm.MAX_STATE} and {ssm.MAX_CONV_KERNEL}")
    if layer.packed_params is None or layer.norm.weight.dtype != torch.bfloat16:
        return "is not packed in bf16 (pack_weights)"
    return ""


def _state_columns(layer: StateLayer | None, owners: list[torch.Tensor]) -> dict[str, int]:
    """A state layer's columns of the weight table (zeros for an attention layer, and for a
    short convolution those it does not have); the state tensors' pointers are bound at the
    first step (``NativeDecoderStack._bind_states``)."""
    tensors: dict[str, torch.Tensor | None] = {}
    if isinstance(layer, Mamba2Mixer):
        params = layer.packed_params
        assert params is not None  # _why_not_walked checked
        tensors = {"conv_weight": params.conv.weight_t, "conv_bias": params.conv.bias, "dt_bias": params.dt_bias,
                   "A_log": params.A_log, "D": params.D, "mixer_norm": layer.norm.weight}
    elif isinstance(layer, ShortConv):
        assert layer.packed_conv is not None
        tensors = {"conv_weight": layer.packed_conv.weight_t, "conv_bias": layer.packed_conv.bias}
    owners += [tensor for tensor in tensors.values() if tensor is not None]
    columns = {name: 0 for name in ("conv_weight", "conv_bias", "conv_state", "ssm_state", "dt_bias", "A_log", "D",
                                    "mixer_norm")}
    return {**columns, **{name: 0 if tensor is None else tensor.data_ptr() for name, tensor in tensors.items()}}


def _state_shape(config: ModelConfig) -> kernels.StateShape:
    """The state layers' sizes: the Mamba2 mixers' (where the model has them) and the short
    convolutions' taps (LFM2's)."""
    ssm, short = config.ssm, config.short_conv
    short_kernel = short.conv_kernel if short is not None else 0
    if ssm is None:
        return kernels.StateShape(short_kernel=short_kernel)
    return kernels.StateShape(ssm.intermediate_size, ssm.conv_dim, ssm.num_heads, ssm.head_dim, ssm.state_size,
                              ssm.num_groups, ssm.conv_kernel, float(ssm.time_step_limit[0]),
                              float(ssm.time_step_limit[1]), ssm.norm_eps, short_kernel)
