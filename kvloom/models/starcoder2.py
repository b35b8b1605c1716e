"""BigCode's StarCoder2 (``Starcoder2ForCausalLM``): Llama's attention (q, k, v and o with
biases; a sliding window where config.json sets one) and Llama's pre-norm layer, with
LayerNorm (a weight and a bias) in place of RMSNorm and a plain MLP, c_proj(gelu(c_fc(x))),
in place of the gated one (``layers.UngatedMLP``, its fc1 / fc2, in the GELU form hidden_act names).

The native walk runs its layers (LayerNorm and the un-gated GELU through cpu_ops.cpp's
layer_norm and gelu_tanh, which the modules call too); tensor parallel too (``layers.UngatedMLP``
splits the MLP's features as GatedMLP does).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.models.layers import ResidualLayerNorm, RMSNorm, UngatedMLP
from kvloom.models.llama import LlamaAttention, LlamaForCausalLM
from kvloom.models.weights import renamed

# Checkpoint names that differ from the modules these layers reuse (layers.UngatedMLP's).
_RENAMES = (("mlp.c_fc.", "mlp.fc1."), ("mlp.c_proj.", "mlp.fc2."))


class Starcoder2DecoderLayer(nn.Module):
    """Llama's pre-norm layer (its forward is the model's) with an un-gated MLP; Nemotron's too,
    and Arcee's with Llama's RMSNorms (``norm_class``)."""

    norm_class: type[RMSNorm] = ResidualLayerNorm

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE_PROCESS, index: int = 0,
                 window: int = 0) -> None:
        super().__init__()
        self.input_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp, window)
        self.post_attention_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.mlp = UngatedMLP(config.architecture, config.hidden_size, config.intermediate_size, config.mlp_bias,
                              config.hidden_act, tp)
        self.local_rope = False


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """Llama's forward over StarCoder2's layers (the same pre-norm residual stream)."""

    checkpoint_renames = _RENAMES
    has_score_head = False
    layer_class = Starcoder2DecoderLayer
    norm_class = ResidualLayerNorm

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(renamed(weights, _RENAMES))
