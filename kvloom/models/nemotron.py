"""NVIDIA's Nemotron (``NemotronForCausalLM``: Nemotron-3, Minitron 4B / 8B): StarCoder2's layer
(LayerNorms with biases, Llama's attention, an un-gated MLP) with ReLU squared in the MLP
(up_proj, down_proj: kvloom's fc1 / fc2), the rotary on the first ``partial_rotary_factor``
of each head (transformers' default for it: 0.5), and LayerNorms that scale by 1 + weight
(``LayerNorm1P``): the checkpoint's weights plus one at load, in the weights' dtype as
transformers adds them, after which they are ordinary LayerNorms.

The native walk runs its layers (ReLU squared: cpu_ops.relu2); tensor parallel as StarCoder2's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvloom.models.layers import ResidualLayerNorm
from kvloom.models.llama import LlamaForCausalLM
from kvloom.models.starcoder2 import Starcoder2DecoderLayer
from kvloom.models.weights import renamed

_RENAMES = (("mlp.up_proj.", "mlp.fc1."), ("mlp.down_proj.", "mlp.fc2."))
_NORM_WEIGHTS = ("input_layernorm.weight", "post_attention_layernorm.weight", "norm.weight")


class NemotronForCausalLM(LlamaForCausalLM):
    """Llama's forward over StarCoder2's layers (the same pre-norm residual stream)."""

    has_score_head = False  # no Nemotron sequence classifier is read
    checkpoint_renames = _RENAMES
    layer_class = Starcoder2DecoderLayer  # LayerNorm, Llama's attention, layers.UngatedMLP (relu2)
    norm_class = ResidualLayerNorm

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_one_plus_norm_weights(renamed(weights, _RENAMES)))


def _one_plus_norm_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """LayerNorm1P's scale, weight + 1, as the weight of an ordinary LayerNorm."""
    for name, tensor in weights:
        yield name, (tensor + 1 if name.endswith(_NORM_WEIGHTS) else tensor)
