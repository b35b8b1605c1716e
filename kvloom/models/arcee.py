"""Arcee's AFM (``ArceeForCausalLM``: AFM-4.5B): Llama's layers with an un-gated MLP of ReLU
squared (up_proj, down_proj: kvloom's fc1 / fc2) in place of the gated SiLU one.

The native walk runs its layers (ReLU squared: cpu_ops.relu2); tensor parallel as StarCoder2's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvloom.models.layers import RMSNorm
from kvloom.models.llama import LlamaForCausalLM
from kvloom.models.starcoder2 import Starcoder2DecoderLayer
from kvloom.models.weights import renamed

_RENAMES = (("mlp.up_proj.", "mlp.fc1."), ("mlp.down_proj.", "mlp.fc2."))


class ArceeDecoderLayer(Starcoder2DecoderLayer):
    """Llama's layer (its RMSNorms, attention and forward), the MLP un-gated: StarCoder2's layer
    with Llama's norms."""

    norm_class = RMSNorm


class ArceeForCausalLM(LlamaForCausalLM):
    has_score_head = False  # no Arcee sequence classifier is read
    checkpoint_renames = _RENAMES
    layer_class = ArceeDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(renamed(weights, _RENAMES))
