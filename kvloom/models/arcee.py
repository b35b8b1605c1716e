"""Arcee's AFM (``ArceeForCausalLM``: AFM-4.5B): Llama's layers with an un-gated MLP of ReLU
squared (up_proj, down_proj: kvloom's fc1 / fc2) in place of the gated SiLU one.

The native walk runs its layers (ReLU squared: cpu_ops.relu2); one process.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.models.layers import RMSNorm, UngatedMLP
from kvloom.models.llama import LlamaAttention, LlamaForCausalLM
from kvloom.models.weights import renamed

_RENAMES = (("mlp.up_proj.", "mlp.fc1."), ("mlp.down_proj.", "mlp.fc2."))


class ArceeDecoderLayer(nn.Module):
    """Llama's layer (its forward is the model's), the MLP un-gated."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE_PROCESS, index: int = 0,
                 window: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = UngatedMLP(config.architecture, config.hidden_size, config.intermediate_size, config.mlp_bias,
                              config.hidden_act)
        self.local_rope = False


class ArceeForCausalLM(LlamaForCausalLM):
    has_score_head = False  # no Arcee sequence classifier is read
    checkpoint_renames = _RENAMES
    layer_class = ArceeDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(renamed(weights, _RENAMES))
