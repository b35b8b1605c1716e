"""AllenAI's OLMoE (``OlmoeForCausalLM``: OLMoE-1B-7B): Llama's layers with OLMo 2's query and key
RMSNorms over the whole projections (not a head each) and a mixture-of-experts FFN in every layer
(``config.moe``: a softmax router's top ``num_experts_per_tok`` of ``num_experts`` gated SiLU
experts, renormalised where ``norm_topk_prob``, the weights rounded to the activation dtype as
transformers' are; models/moe.py runs it). Its ``clip_qkv`` (after those norms, where OLMo 1
clips before any) is refused by name (config.py).

The native walk runs its layers, experts and all (models/decoder_stack.py); tensor parallel,
as modules, with its whole-projection q/k norms as OLMo 2's (``layers.SplitRMSNorm``).
"""

from __future__ import annotations

from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.models.layers import RMSNorm, split_whole_norms
from kvloom.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from kvloom.models.sharding import TensorSlice, whole_norm_slice


class OlmoeDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (its MoE FFN from config.moe), the q and k norms over the whole projections."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE_PROCESS, index: int = 0,
                 window: int = 0) -> None:
        super().__init__(config, tp, index, window)
        self.self_attn.q_norm = RMSNorm(self.self_attn.q_size, config.rms_norm_eps)
        self.self_attn.k_norm = RMSNorm(self.self_attn.kv_size, config.rms_norm_eps)
        split_whole_norms(self.self_attn, config, tp)


class OlmoeForCausalLM(LlamaForCausalLM):
    has_score_head = False  # no OLMoE sequence classifier is read
    layer_class = OlmoeDecoderLayer

    def weight_slice(self, hf_name: str) -> TensorSlice | None:
        return whole_norm_slice(self.config, hf_name, self.tp.rank, self.tp.size) or super().weight_slice(hf_name)
