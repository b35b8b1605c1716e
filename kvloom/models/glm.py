"""Zhipu's GLM-4 (``GlmForCausalLM``: glm-4-9b-chat-hf) and GLM-4-0414 (``Glm4ForCausalLM``:
GLM-4-9B-0414, GLM-Z1): Llama's layers with q/k/v biases, the gate and up projections fused in
the checkpoint (as kvloom holds them), and a rotary that turns adjacent pairs of the first half
of each head (``partial_rotary_factor``, 0.5 by default: the q/k rows of that part regrouped at
load, ``config.interleaved_rotary``, the rest as they are). GLM-4-0414 norms each block's output
before it joins the stream (Gemma 2's sandwich, in Llama's RMSNorms: its post_self_attn_layernorm
is kvloom's post_attention_layernorm, its post_attention_layernorm the MLP's input norm,
pre_feedforward_layernorm, its post_mlp_layernorm post_feedforward_layernorm).

The native walk runs both (GLM-4-0414's layers with Gemma 2's block norms); tensor parallel runs
GLM-4 (Llama's layers), not GLM-4-0414's.
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
from kvloom.models.layers import GatedMLP, RMSNorm
from kvloom.models.llama import LlamaAttention, StreamLayersForCausalLM
from kvloom.models.weights import renamed

# Checkpoint names -> the modules that hold them (the MLP's input norm first: its name is
# what the attention output's norm becomes).
_RENAMES = (("post_attention_layernorm.", "pre_feedforward_layernorm."),
            ("post_self_attn_layernorm.", "post_attention_layernorm."),
            ("post_mlp_layernorm.", "post_feedforward_layernorm."))


class Glm4DecoderLayer(nn.Module):
    """Llama's layer with each block's output normed before it is added to the stream."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE_PROCESS, index: int = 0,
                 window: int = 0) -> None:
        super().__init__()
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"{config.architecture}: hidden_act {config.hidden_act!r} is not supported "
                             "(supported: silu)")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # the attention output's
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, tp)
        self.local_rope = False

    def forward(self, stream: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                kv_cache: torch.Tensor, backend: AttentionBackend[Any], metadata: Any,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream after this layer (of ``rows`` only, where given: every row's
        K and V still go into the cache)."""
        attended = self.self_attn(self.input_layernorm(stream), rotary, batch, kv_cache, backend, metadata, rows)
        if rows is not None:
            stream = stream[rows]
        stream = stream + self.post_attention_layernorm(attended)
        return stream + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(stream)))


class Glm4ForCausalLM(StreamLayersForCausalLM):
    has_score_head = False  # no GLM-4-0414 sequence classifier is read
    checkpoint_renames = _RENAMES
    layer_class = Glm4DecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(renamed(weights, _RENAMES))
