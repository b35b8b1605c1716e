"""AllenAI's OLMo 1 (``OlmoForCausalLM``: OLMo-1B-hf, OLMo-7B-0724-hf): Llama's layers with
LayerNorms that have no weight and no bias (in float32, eps 1e-5), and, where config.json sets
``clip_qkv``, every query, key and value number clamped to [-clip, clip] after the projection.

The native walk runs its layers (its norms as LayerNorms of weight 1 and bias 0, the clip
by cpu_ops.cpp's clamp) in bf16 on a CPU.
"""

from __future__ import annotations

from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.models.layers import UnweightedLayerNorm
from kvloom.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class OlmoDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE_PROCESS, index: int = 0,
                 window: int = 0) -> None:
        super().__init__(config, tp, index, window)
        self.input_layernorm = UnweightedLayerNorm(config.hidden_size)
        self.post_attention_layernorm = UnweightedLayerNorm(config.hidden_size)


class OlmoForCausalLM(LlamaForCausalLM):
    has_score_head = False  # no OLMo sequence classifier is read
    layer_class = OlmoDecoderLayer
    norm_class = UnweightedLayerNorm  # type: ignore[assignment]  # RMSNorm's call and forward, no weight
