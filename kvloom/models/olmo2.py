"""AllenAI's OLMo 2 (``Olmo2ForCausalLM``) and OLMo 3 (``Olmo3ForCausalLM``): Llama's
attention, MLP and loading, with the norms after each block instead of before it (the
attention's and the MLP's outputs are normed, then added to the stream; no input norm),
every query and key RMS-normed over the whole projection (all heads at once) before the
rotary, and each norm's product with its weight taken in float32 before the cast. OLMo 3
mixes sliding-window layers with full ones (config.json's ``layer_types``; three in four),
each kind with its own rotary where config.json gives them their own.

The native walk runs these layers too (models/decoder_stack.py: no input norm, each block's
output normed and added through the kernels the modules call; the q/k norms over each
token's whole q and k). Under tensor parallel a rank holds some heads of q and k: its q/k
norms are ``layers.SplitRMSNorm``s (the sums of squares all-reduced over the ranks) and the
modules run its steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvloom.attention.base import AttentionBackend
from kvloom.batch import ForwardBatch
from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.models.layers import Float32ScaledRMSNorm, GatedMLP, RMSNorm, split_whole_norms
from kvloom.models.llama import LlamaAttention, StreamLayersForCausalLM
from kvloom.models.sharding import TensorSlice, whole_norm_slice

OLMO_ARCHITECTURES = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")


class Olmo2DecoderLayer(nn.Module):
    # OLMo's norms multiply by their weight in float32, and its q and k norms span the whole
    # projections, not a head each (EXAONE 4, models/exaone4.py, takes Llama's of a head).
    norm_class: type[RMSNorm] = Float32ScaledRMSNorm
    head_norms = False

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE_PROCESS, index: int = 0,
                 window: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, tp, window)
        if not self.head_norms:  # of this rank's heads' columns, their statistics over every rank's
            self.self_attn.q_norm = self.norm_class(self.self_attn.q_size, config.rms_norm_eps)
            self.self_attn.k_norm = self.norm_class(self.self_attn.kv_size, config.rms_norm_eps)
            split_whole_norms(self.self_attn, config, tp)
        self.post_attention_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, tp)
        self.post_feedforward_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.local_rope = config.uses_local_rope(index)

    def forward(self, stream: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                kv_cache: torch.Tensor, backend: AttentionBackend[Any], metadata: Any,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream after this layer (of ``rows`` only, where given)."""
        attended = self.self_attn(stream, rotary, batch, kv_cache, backend, metadata, rows)
        stream = (stream if rows is None else stream[rows]) + self.post_attention_layernorm(attended)
        return stream + self.post_feedforward_layernorm(self.mlp(stream))


class Olmo2ForCausalLM(StreamLayersForCausalLM):
    has_score_head = False  # no OLMo sequence classifier is read
    layer_class = Olmo2DecoderLayer
    norm_class = Float32ScaledRMSNorm

    def weight_slice(self, hf_name: str) -> TensorSlice | None:
        whole = None if self.layer_class.head_norms else whole_norm_slice(self.config, hf_name, self.tp.rank,
                                                                          self.tp.size)
        return whole or super().weight_slice(hf_name)

