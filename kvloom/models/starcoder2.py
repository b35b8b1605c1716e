"""BigCode's StarCoder2 (``Starcoder2ForCausalLM``): Llama's attention (q, k, v and o with
biases; a sliding window where config.json sets one) and Llama's pre-norm layer, with
LayerNorm (a weight and a bias) in place of RMSNorm and a plain MLP, c_proj(gelu(c_fc(x))),
GELU's tanh form, in place of the gated one.

Modules only (the native walk is Llama's), one process (the MLP's c_fc / c_proj are not
among the tensors tensor parallel splits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.models.layers import ResidualLayerNorm
from kvloom.models.llama import LlamaAttention, LlamaForCausalLM

ACTIVATIONS = ("gelu_pytorch_tanh",)


class Starcoder2MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Starcoder2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE_PROCESS, index: int = 0,
                 window: int = 0) -> None:
        super().__init__()
        self.input_layernorm = ResidualLayerNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp, window)
        self.post_attention_layernorm = ResidualLayerNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Starcoder2MLP(config)
        self.local_rope = False


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """Llama's forward over StarCoder2's layers (the same pre-norm residual stream)."""

    has_score_head = False
    layer_class = Starcoder2DecoderLayer
    norm_class = ResidualLayerNorm
    modules_only = "LayerNorm, a plain GELU MLP"  # and one process: sharding.ONE_PROCESS
