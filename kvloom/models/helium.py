"""Kyutai's Helium (``HeliumForCausalLM``: Helium-1 2B): Llama's layers with RMSNorms that
multiply by their weight in float32 before the cast (OLMo 2's, ``Float32ScaledRMSNorm``) and a
rotary that turns adjacent pairs of each head (GLM's: its q and k rows are regrouped at load
for Llama's rotary, ``config.interleaved_rotary``, as ERNIE 4.5's).

The native walk runs its layers (its norms are cpu_ops.cpp's rms_norm_scaled, offset 0).
"""

from __future__ import annotations

from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.models.layers import Float32ScaledRMSNorm
from kvloom.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class HeliumDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE_PROCESS, index: int = 0,
                 window: int = 0) -> None:
        super().__init__(config, tp, index, window)
        self.input_layernorm = Float32ScaledRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Float32ScaledRMSNorm(config.hidden_size, config.rms_norm_eps)


class HeliumForCausalLM(LlamaForCausalLM):
    has_score_head = False  # no Helium sequence classifier is read
    layer_class = HeliumDecoderLayer
    norm_class = Float32ScaledRMSNorm
