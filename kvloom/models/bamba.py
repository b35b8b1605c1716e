"""Bamba (``BambaForCausalLM``), IBM Granite 4.0 (``GraniteMoeHybridForCausalLM``) and
LiquidAI LFM2 (``Lfm2ForCausalLM``, ``Lfm2MoeForCausalLM``): state layers (Mamba2 mixers, or
LFM2's gated short convolutions, models/short_conv.py) and a few attention layers, each
followed by a feed-forward block.

The attention layers are Llama's (fused QKV, the paged KV pool through the attention
backend). The KV pool holds only the attention layers (``ModelConfig.num_kv_layers``):
attention layer ``i`` writes pool layer ``kv_layer[i]``, its rank among them. The mixers
are Mamba2's (models/mamba2.py), with their state in the requests' state slots.

Granite 4.0 is Bamba's stack with Granite's four multipliers (``config.scales``: the
embedding's, each block's output before it joins the residual stream, the attention
scores' instead of 1/sqrt(head_dim), the logits' divisor), its rotary over the whole
head or, as its published models, none (``position_embedding_type``: then every layer is
in ``config.no_rope_layers``), and as the feed-forward block either a dense gated MLP
(its ``shared_mlp``; no experts) or GraniteMoe's routed experts beside that shared MLP
(SparseMoE with an ungated shared expert). Bamba rotates the first half of each head.
LFM2's layers are the same stack under its own names (``LFM2_NAMES``), its attention with
per-head q/k norms; LFM2-MoE's sparse layers are SparseMoE routed by sigmoid.
transformers 5.25's modeling_bamba.py, modeling_granitemoehybrid.py, modeling_lfm2.py and
modeling_lfm2_moe.py are the references.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from kvloom.attention.base import AttentionBackend
from kvloom.attention.cpu_paged import CPUPagedBackend
from kvloom.batch import ForwardBatch
from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.model_families import GRANITE_HYBRID
from kvloom.models import ssm_ops
from kvloom.models.decoder_stack import NativeDecoderStack
from kvloom.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, VocabParallelEmbedding
from kvloom.models.llama import LlamaAttention
from kvloom.models.mamba2 import Mamba2Mixer, allocate_mixer_state, load_named_weights
from kvloom.models.moe import SparseMoE
from kvloom.models.packed_linear import pack_with_tied_head
from kvloom.models.registry import CausalLM
from kvloom.models.short_conv import ShortConv
from kvloom.models.weights import WeightFiller, rename

PARTIAL_ROTARY_FACTOR = 0.5  # transformers' BambaConfig hard-codes it
# LFM2's checkpoint names -> Bamba's modules' (``rename``: each fragment replaced in order).
LFM2_NAMES = (("operator_norm", "input_layernorm"), ("ffn_norm", "pre_ff_layernorm"),
              ("self_attn.out_proj", "self_attn.o_proj"), ("q_layernorm", "q_norm"), ("k_layernorm", "k_norm"),
              ("feed_forward.w1", "feed_forward.gate_proj"), ("feed_forward.w3", "feed_forward.up_proj"),
              ("feed_forward.w2", "feed_forward.down_proj"), ("embedding_norm", "final_layernorm"))


class BambaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kind: str, index: int) -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if kind == "mamba":
            assert config.ssm is not None
            self.mamba = Mamba2Mixer(config.hidden_size, config.ssm)
        elif kind == "conv":
            assert config.short_conv is not None
            self.conv = ShortConv(config.hidden_size, config.short_conv)
        else:
            self.self_attn = LlamaAttention(config)  # its rotary's width: the tables'
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.moe
        self.feed_forward: GatedMLP | SparseMoE = (
            SparseMoE(config.hidden_size, moe) if moe is not None and moe.is_sparse(index)
            else GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias))


class BambaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__()
        stateful = config.ssm or config.short_conv
        if stateful is None or tp.size > 1:
            raise ValueError(f"{config.architecture} needs a state layers' config and runs in one process")
        self.config, self.conv_kernel, self.tp = config, stateful.conv_kernel, tp
        self.granite = config.architecture == GRANITE_HYBRID
        self.lfm2 = config.short_conv is not None
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.blocks = [BambaDecoderLayer(config, kind, index) for index, kind in enumerate(stateful.layer_kinds)]
        self.layers = nn.ModuleList(self.blocks)  # registered; ``blocks`` is the typed view
        self.kv_layer = {layer: rank for rank, layer in enumerate(stateful.attention_layers)}
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        rotary_dim = (int(config.head_dim * PARTIAL_ROTARY_FACTOR) if config.architecture == "BambaForCausalLM"
                      else config.rotary_dim or config.head_dim)
        self.rotary_dim = rotary_dim  # the tables' width (the native walk's)
        # None where no layer turns one (Granite 4.0's published models): no table to hold.
        self.rotary = (RotaryEmbedding(rotary_dim, max_positions, config.rope_theta, config.rope_scaling_dict)
                       if len(config.no_rope_layers) < config.num_layers else None)
        scales = config.scales
        self.embedding_scale = scales.embedding if scales is not None else 1.0
        self.residual_scale = scales.residual if scales is not None else 1.0
        self.logits_divisor = scales.logits if scales is not None else 1.0
        self.lm_head: nn.Module | None = (None if config.tie_word_embeddings else
                                          nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        # The layers walked in one native call (models/decoder_stack.py: Mamba2 mixers and
        # attention, each with Llama's MLP), once asked for by use_native_stack; the module
        # path below is the reference and the fallback.
        self.native_stack: NativeDecoderStack | None = None

    def forward(self, batch: ForwardBatch, kv_caches: torch.Tensor, backend: AttentionBackend[Any],
                metadata: Any) -> torch.Tensor:
        """The final hidden states [tokens, hidden]; kv_caches holds the attention layers."""
        spans = ssm_ops.SSMSpans.of(batch, self.conv_kernel)
        residual = self.embed_tokens(batch.input_ids)  # the residual stream, added to in place
        if self.embedding_scale != 1.0:  # Granite's, in the model's dtype as HF's
            residual = residual * self.embedding_scale
        rotary = self.rotary.cos_sin_for(batch) if self.rotary is not None else None
        stack = self.native_stack
        if (stack is not None and isinstance(backend, CPUPagedBackend)  # serves() holds it to that
                and stack.serves(kv_caches, backend, metadata, batch.lora_slots is not None)):
            if rotary is None:  # no layer turns (every row of the table unread)
                rotary = (torch.empty(batch.num_tokens, self.rotary_dim),) * 2
            walked, stream = stack(residual, rotary, batch, kv_caches, backend, metadata, spans=spans)
            final: torch.Tensor = self.final_layernorm(self._into_residual(walked), stream)
            return final  # the rows batch.output_rows names, if any
        hidden: torch.Tensor | None = None  # the previous block's output, not yet added to the stream
        for index, layer in enumerate(self.blocks):
            normed = (layer.input_layernorm(residual) if hidden is None
                      else layer.input_layernorm(self._into_residual(hidden), residual))
            if layer.kind == "mamba":
                hidden = layer.mamba(normed, spans)
            elif layer.kind == "conv":
                hidden = layer.conv(normed, spans)
            else:
                hidden = layer.self_attn(normed, rotary, batch, kv_caches[self.kv_layer[index]], backend, metadata)
            hidden = layer.feed_forward(layer.pre_ff_layernorm(self._into_residual(hidden), residual))
        assert hidden is not None  # a model has a layer
        out: torch.Tensor = self.final_layernorm(self._into_residual(hidden), residual)
        return batch.final_states(out)

    def _into_residual(self, hidden: torch.Tensor) -> torch.Tensor:
        """A block's output as it joins the stream: Granite's times its residual multiplier."""
        return hidden if self.residual_scale == 1.0 else hidden * self.residual_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            logits = torch.nn.functional.linear(hidden, self.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        return logits if self.logits_divisor == 1.0 else logits / self.logits_divisor

    def allocate_state(self, num_slots: int) -> int:
        return allocate_mixer_state(self, num_slots)

    def use_native_stack(self) -> str | None:
        """Walk the decoder layers in one native call from now on, where a forward's cache
        and backend allow (after ``pack_weights``). Returns None, or why the model cannot."""
        self.native_stack, reason = NativeDecoderStack.build(self)
        return None if self.native_stack is not None else reason

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        attention = [layer.self_attn for layer in self.blocks if layer.kind == "attention"]
        q, kv = (attention[0].q_size, attention[0].kv_size) if attention else (0, 0)
        inter = self.config.intermediate_size
        fused = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
            "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
            "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
            "feed_forward.gate_proj": ("feed_forward.gate_up_proj", 0, inter),
            "feed_forward.up_proj": ("feed_forward.gate_up_proj", inter, inter),
        }
        named = ((name.removeprefix("model."), tensor) for name, tensor in weights)
        if not self.granite and not self.lfm2:
            load_named_weights(self, named, fused)
            return
        filler = WeightFiller(self)
        load_named_weights(self, self._checkpoint_names(named, filler), fused, filler)

    def _checkpoint_names(self, weights: Iterable[tuple[str, torch.Tensor]],
                          filler: WeightFiller) -> Iterator[tuple[str, torch.Tensor]]:
        """Granite 4.0's and LFM2's checkpoint names as Bamba's, and their MoE tensors into
        the layer's SparseMoE, which counts what it fills into ``filler``. LFM2: renamed by
        ``LFM2_NAMES``; LFM2-MoE's ``feed_forward.gate``, ``expert_bias`` and ``experts.*``
        are the MoE's router, selection bias and experts. Granite 4.0: ``norm`` is
        ``final_layernorm``, ``post_attention_layernorm`` is ``pre_ff_layernorm``;
        ``shared_mlp``'s fused [gate | up] ``input_linear`` and its ``output_linear`` are a
        dense layer's gate_up_proj and down_proj, or beside experts the MoE's shared
        expert; ``block_sparse_moe.*`` (the router and the fused experts) go to the MoE."""
        for name, tensor in weights:
            if self.lfm2:
                name = rename(name, LFM2_NAMES)
            layer, _, inside = name.removeprefix("layers.").partition(".")
            if not name.startswith("layers.") or not layer.isdigit():
                yield ("final_layernorm.weight" if name == "norm.weight" else name), tensor
                continue
            ffn = self.blocks[int(layer)].feed_forward
            prefix = f"layers.{layer}."
            parts = self._moe_parts(inside, tensor) if isinstance(ffn, SparseMoE) else None
            if parts is None:
                inside = (inside.replace("post_attention_layernorm", "pre_ff_layernorm")
                          .replace("shared_mlp.input_linear", "feed_forward.gate_up_proj")
                          .replace("shared_mlp.output_linear", "feed_forward.down_proj"))
                yield prefix + inside, tensor
                continue
            assert isinstance(ffn, SparseMoE)
            for part, value in parts.items():
                for parameter, count in ffn.load_hf(part, value).items():
                    filler.count(f"{prefix}feed_forward.{parameter}", count)

    def _moe_parts(self, inside: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """A layer tensor's parts under SparseMoE's names (``load_hf``'s), or None where it
        is not the MoE's."""
        if self.lfm2:
            if inside == "feed_forward.expert_bias":
                return {"gate.e_score_correction_bias": tensor}
            return {inside.removeprefix("feed_forward."): tensor} if inside.startswith("feed_forward.") else None
        if inside.startswith("block_sparse_moe."):
            return {inside.removeprefix("block_sparse_moe."): tensor}
        if inside == "shared_mlp.input_linear.weight":  # [gate | up], as the shared expert's two halves
            gate, up = tensor.chunk(2, dim=0)
            return {"shared_expert.gate_proj.weight": gate, "shared_expert.up_proj.weight": up}
        if inside == "shared_mlp.output_linear.weight":
            return {"shared_expert.down_proj.weight": tensor}
        return None

    def weight_slice(self, hf_name: str) -> None:
        return None

    def pack_weights(self, matmul: str = "invariant") -> int:
        return pack_with_tied_head(self, self.embed_tokens.weight, matmul)

    def first_layers(self, num_layers: int) -> CausalLM:
        raise ValueError("layer_skip drafts are not supported for state-space models")
