"""Bamba (``BambaForCausalLM``): Mamba2 mixers and a few attention layers, each
followed by a gated MLP.

The attention layers are Llama's (fused QKV, the paged KV pool through the attention
backend) with Bamba's partial rotary embedding: only the first half of each head's
dimensions rotate. The KV pool holds only the attention layers
(``ModelConfig.num_kv_layers``): attention layer ``i`` writes pool layer
``kv_layer[i]``, its rank among them. The mixers are Mamba2's (models/mamba2.py), with
their state in the requests' state slots. transformers 5.24's modeling_bamba.py is
the reference.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from kvloom.attention.base import AttentionBackend
from kvloom.batch import ForwardBatch
from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.models import ssm_ops
from kvloom.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, VocabParallelEmbedding
from kvloom.models.llama import LlamaAttention
from kvloom.models.mamba2 import Mamba2Mixer, allocate_mixer_state, load_named_weights
from kvloom.models.packed_linear import pack_with_tied_head
from kvloom.models.registry import CausalLM

PARTIAL_ROTARY_FACTOR = 0.5  # transformers' BambaConfig hard-codes it


class BambaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kind: str) -> None:
        super().__init__()
        assert config.ssm is not None
        self.kind = kind
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if kind == "mamba":
            self.mamba = Mamba2Mixer(config.hidden_size, config.ssm)
        else:
            self.self_attn = LlamaAttention(config)  # its half-head rotary: the tables' width
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)


class BambaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__()
        if config.ssm is None or tp.size > 1:
            raise ValueError("BambaForCausalLM needs an SSM config and runs in one process")
        self.config, self.ssm = config, config.ssm
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.blocks = [BambaDecoderLayer(config, kind) for kind in config.ssm.layer_kinds]
        self.layers = nn.ModuleList(self.blocks)  # registered; ``blocks`` is the typed view
        self.kv_layer = {layer: rank for rank, layer in enumerate(config.ssm.attention_layers)}
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(int(config.head_dim * PARTIAL_ROTARY_FACTOR), max_positions,
                                      config.rope_theta, config.rope_scaling_dict)
        self.lm_head: nn.Module | None = (None if config.tie_word_embeddings else
                                          nn.Linear(config.hidden_size, config.vocab_size, bias=False))

    def forward(self, batch: ForwardBatch, kv_caches: torch.Tensor, backend: AttentionBackend[Any],
                metadata: Any) -> torch.Tensor:
        """The final hidden states [tokens, hidden]; kv_caches holds the attention layers."""
        spans = ssm_ops.SSMSpans.of(batch, self.ssm.conv_kernel)
        residual = self.embed_tokens(batch.input_ids)  # the residual stream, added to in place
        rotary = self.rotary.cos_sin_for(batch)
        hidden = None  # the previous block's output, not yet added to the stream
        for index, layer in enumerate(self.blocks):
            normed = (layer.input_layernorm(residual) if hidden is None
                      else layer.input_layernorm(hidden, residual))
            if layer.kind == "mamba":
                hidden = layer.mamba(normed, spans)
            else:
                hidden = layer.self_attn(normed, rotary, batch, kv_caches[self.kv_layer[index]], backend, metadata)
            hidden = layer.feed_forward(layer.pre_ff_layernorm(hidden, residual))
        out: torch.Tensor = self.final_layernorm(hidden, residual)
        return batch.final_states(out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return torch.nn.functional.linear(hidden, self.embed_tokens.weight)
        logits: torch.Tensor = self.lm_head(hidden)
        return logits

    def allocate_state(self, num_slots: int) -> int:
        return allocate_mixer_state(self, num_slots)

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
        load_named_weights(self, ((name.removeprefix("model."), tensor) for name, tensor in weights), fused)

    def weight_slice(self, hf_name: str) -> None:
        return None

    def pack_weights(self, matmul: str = "invariant") -> int:
        return pack_with_tied_head(self, self.embed_tokens.weight, matmul)

    def use_native_stack(self) -> str | None:
        return "the native decoder stack walks Llama layers; Bamba mixes in Mamba2 layers"

    def first_layers(self, num_layers: int) -> CausalLM:
        raise ValueError("layer_skip drafts are not supported for state-space models")
