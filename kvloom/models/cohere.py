"""Cohere's Command R family: Command R / R+ and Aya (``CohereForCausalLM``) and Command R7B
(``Cohere2ForCausalLM``). Each layer runs attention and a gated SiLU MLP side by side on one
LayerNorm's output (no bias; mean and variance in float32) and adds both to the stream
(stream + attention + MLP, transformers' order: StableLM's parallel layer); the rotary turns
adjacent pairs of each head (q/k rows regrouped at load, ``config.interleaved_rotary``); the
logits are multiplied by ``logit_scale``; the embedding is the output head. Command R+'s
``use_qk_norm`` LayerNorms each query and key head with its own weights before the rotary
(their weights regrouped as the rows they norm). Command R7B's layers slide a window but every
``sliding_window_pattern``-th one, which attends to everything and turns no rotary.

The native walk runs the layers (but with ``use_qk_norm``: LayerNorms of heads); one process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.models.layers import GatedMLP, ResidualLayerNorm
from kvloom.models.llama import LlamaAttention, StreamLayersForCausalLM
from kvloom.models.stablelm import PerHeadLayerNorm, StableLmDecoderLayer
from kvloom.models.weights import halves_from_pairs


def _layer_norm(config: ModelConfig) -> ResidualLayerNorm:
    return ResidualLayerNorm(config.hidden_size, config.rms_norm_eps, bias=False)


class CohereDecoderLayer(StableLmDecoderLayer):
    """StableLM's layer side by side (its forward), its norms without biases."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE_PROCESS, index: int = 0,
                 window: int = 0) -> None:
        torch.nn.Module.__init__(self)
        if config.hidden_act != "silu":
            raise ValueError(f"{config.architecture}: hidden_act {config.hidden_act!r} is not supported "
                             "(supported: silu)")
        self.parallel = True
        self.input_layernorm = _layer_norm(config)
        self.self_attn = LlamaAttention(config, tp, window)
        if config.qk_norm:  # Command R+'s: a LayerNorm of each head, its own weights, no bias
            self.self_attn.q_norm = PerHeadLayerNorm(config.num_heads, config.head_dim, config.rms_norm_eps)
            self.self_attn.k_norm = PerHeadLayerNorm(config.num_kv_heads, config.head_dim, config.rms_norm_eps)
        self.post_attention_layernorm = None
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, tp)
        self.local_rope = False


class CohereForCausalLM(StreamLayersForCausalLM):
    has_score_head = False  # no Cohere sequence classifier is read
    layer_class = CohereDecoderLayer
    norm_class = ResidualLayerNorm  # built without its bias below

    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__(config, max_positions, tp)
        self.norm = _layer_norm(config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._head_norms_regrouped(weights))

    def _head_norms_regrouped(self, weights: Iterable[tuple[str, torch.Tensor]]
                              ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each head's q/k norm weights ([heads, head_dim]) in the order of the rows they
        norm: regrouped into halves as those rows are (the norm's mean and variance do not
        depend on the order, its weights follow their rows)."""
        for name, tensor in weights:
            if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
                heads = tensor.shape[0]
                tensor = halves_from_pairs(tensor.reshape(-1), heads).reshape(-1)
            yield name, tensor
