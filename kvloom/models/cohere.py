"""Cohere's Command R family: Command R / R+ and Aya (``CohereForCausalLM``) and Command R7B
(``Cohere2ForCausalLM``). Each layer runs attention and a gated SiLU MLP side by side on one
LayerNorm's output (no bias; mean and variance in float32) and adds both to the stream
(stream + attention + MLP, transformers' order: StableLM's parallel layer); the rotary turns
adjacent pairs of each head (q/k rows regrouped at load, ``config.interleaved_rotary``); the
logits are multiplied by ``logit_scale``; the embedding is the output head. Command R+'s
``use_qk_norm`` LayerNorms each query and key head with its own weights before the rotary
(their weights regrouped as the rows they norm). Command R7B's layers slide a window but every
``sliding_window_pattern``-th one, which attends to everything and turns no rotary.

The native walk runs the layers (but with ``use_qk_norm``: LayerNorms of heads); under tensor
parallel each rank holds its heads' norms.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.models.layers import ResidualLayerNorm
from kvloom.models.llama import StreamLayersForCausalLM
from kvloom.models.sharding import TensorSlice, column_split
from kvloom.models.stablelm import StableLmDecoderLayer
from kvloom.models.weights import halves_from_pairs


def _layer_norm(config: ModelConfig) -> ResidualLayerNorm:
    return ResidualLayerNorm(config.hidden_size, config.rms_norm_eps, bias=False)


class CohereDecoderLayer(StableLmDecoderLayer):
    """StableLM's layer (its forward and its per-head q/k norms, Command R+'s), always side by
    side, its LayerNorms without biases."""

    always_parallel = True
    norm_biases = False


class CohereForCausalLM(StreamLayersForCausalLM):
    has_score_head = False  # no Cohere sequence classifier is read
    layer_class = CohereDecoderLayer
    norm_class = ResidualLayerNorm  # built without its bias below

    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__(config, max_positions, tp)
        self.norm = _layer_norm(config)

    def weight_slice(self, hf_name: str) -> TensorSlice | None:
        """Command R+'s per-head q/k norm weights ([heads, head_dim]) by this rank's heads."""
        if hf_name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            heads = self.config.num_heads if ".q_norm." in hf_name else self.config.num_kv_heads
            return TensorSlice(0, *column_split(heads, self.tp.rank, self.tp.size)) if self.tp.size > 1 else None
        return super().weight_slice(hf_name)

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
