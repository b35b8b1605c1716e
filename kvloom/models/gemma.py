"""Google's Gemma (``GemmaForCausalLM``), Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3's
text models (``Gemma3ForCausalLM``: Gemma 3 1B and the text-only checkpoints): Llama's
attention and loading, with what Gemma changes (``config.gemma``,
model_families.GemmaLayers):

- every RMSNorm scales by (1 + weight), in float32 before the cast (layers.GemmaRMSNorm);
- the embedding is scaled by sqrt(hidden_size), that factor rounded to the model's dtype
  as transformers rounds it; the output head is the embedding (tied);
- the gated MLP's activation is GELU's tanh form (GeGLU);
- Gemma 2 and 3 norm each block's output before it joins the residual stream
  (post-attention and post-feedforward norms; a pre-feedforward norm where Llama has its
  post-attention one), scale attention scores by ``query_pre_attn_scalar`` ** -0.5
  (``config.scales``) and mix sliding-window layers with full-attention ones (config.json's
  ``layer_types``; the window is attended as one, not capped);
- Gemma 2 softcaps the attention scores (every backend's ``softcap``) and the logits;
- Gemma 3 norms every query and key head, and its sliding-window layers turn the rotary
  at their own base (``config.local_rope_theta``, LlamaForCausalLM's ``local_rotary``),
  five of them to one full layer.

The native walk (models/decoder_stack.py) runs these layers too, through the same
kernels (cpu_ops.cpp's rms_norm_scaled and gelu_tanh_and_mul, the attention's softcap, the
local rotary table); the modules below are its reference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvloom.attention.base import AttentionBackend
from kvloom.batch import ForwardBatch
from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.models.layers import GatedMLP, GemmaRMSNorm
from kvloom.models.llama import LlamaAttention, LlamaForCausalLM


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE_PROCESS, index: int = 0,
                 window: int = 0) -> None:
        super().__init__()
        assert config.gemma is not None
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp, window)
        # Gemma: the MLP's input norm. Gemma 3: the attention output's norm (sandwich_norms).
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm: GemmaRMSNorm | None = None
        self.post_feedforward_layernorm: GemmaRMSNorm | None = None
        if config.gemma.sandwich_norms:
            self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, tp, "gelu_tanh")
        self.local_rope = config.uses_local_rope(index)  # Gemma 3's windowed layers: their own rotary base

    def forward(self, normed: torch.Tensor, residual: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch, kv_cache: torch.Tensor, backend: AttentionBackend[Any], metadata: Any,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer over its normed input; returns (its output, not yet added to the
        stream, and the stream, which the MLP's input norm has added the attention's
        output into). With ``rows``, those rows only (the stream cut to them too)."""
        hidden = self.self_attn(normed, rotary, batch, kv_cache, backend, metadata, rows)
        if rows is not None:
            residual = residual[rows]
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            return self.mlp(self.post_attention_layernorm(hidden, residual)), residual
        normed = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(normed)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    has_score_head = False  # no Gemma sequence classifier is read
    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    def forward(self, batch: ForwardBatch, kv_caches: torch.Tensor, backend: AttentionBackend[Any],
                metadata: Any) -> torch.Tensor:
        """Returns the final hidden states, [tokens, hidden] (or the rows
        ``batch.output_rows`` names, whose last layer alone is computed)."""
        embedded = self.embed_tokens(batch.input_ids)
        # transformers' normalizer is a tensor of the hidden states' dtype: sqrt(hidden) rounded to it.
        residual = embedded * torch.tensor(self.config.hidden_size ** 0.5, dtype=embedded.dtype)
        full = self.rotary.cos_sin_for(batch)
        local = self.local_rotary.cos_sin_for(batch) if self.local_rotary is not None else full
        stack = self.native_stack
        if stack is not None and stack.serves(kv_caches, backend, metadata, batch.lora_slots is not None):
            hidden, residual = stack(residual, full, batch, kv_caches, backend, metadata,
                                     local if self.local_rotary is not None else None)
            return self.norm(hidden, residual)  # the rows batch.output_rows names, if any
        rows = batch.output_rows if self.tp.size == 1 else None
        last = len(self.layers) - 1
        hidden = None  # the previous layer's output, not yet added to the stream
        for index, layer in enumerate(self.layers):
            assert isinstance(layer, GemmaDecoderLayer)
            normed = (layer.input_layernorm(residual) if hidden is None
                      else layer.input_layernorm(hidden, residual))
            hidden, residual = layer(normed, residual, local if layer.local_rope else full, batch, kv_caches[index],
                                     backend, metadata, rows if index == last else None)
        out: torch.Tensor = self.norm(hidden, residual)
        return out if rows is not None else batch.final_states(out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.gemma.final_softcap if self.config.gemma is not None else None
        return logits if cap is None else torch.tanh(logits / cap) * cap
