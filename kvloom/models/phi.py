"""Microsoft's Phi-1, Phi-1.5 and Phi-2 (``PhiForCausalLM``): attention and MLP side by side
on one LayerNorm's output (a layer adds both to the stream at once: attention + MLP +
residual, transformers' order), a bias on every projection and on the output head, the
rotary on the first ``partial_rotary_factor`` of each head, a plain MLP fc2(act(fc1(x))),
and, where config.json sets ``qk_layernorm``, each query and key head LayerNormed before the
rotary. The attention is Llama's (``dense`` is its o projection).

The native walk runs its layers (attention and MLP side by side: ``parallel``), unless
``qk_layernorm`` (LayerNorms of heads, which it does not run); tensor parallel
too (the modules: side by side, each block all-reduced before the add).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from kvloom.attention.base import AttentionBackend
from kvloom.batch import ForwardBatch
from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.models.layers import ResidualLayerNorm, UngatedMLP
from kvloom.models.llama import LlamaAttention, StreamLayersForCausalLM
from kvloom.models.sharding import TensorSlice
from kvloom.models.weights import renamed

# Checkpoint names that differ from the Llama modules these layers reuse.
_RENAMES = (("self_attn.dense.", "self_attn.o_proj."), ("self_attn.q_layernorm.", "self_attn.q_norm."),
            ("self_attn.k_layernorm.", "self_attn.k_norm."), ("final_layernorm.", "norm."))


class PhiDecoderLayer(nn.Module):
    parallel = True  # attention and MLP on one norm's output, added together (the native walk reads it)

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE_PROCESS, index: int = 0,
                 window: int = 0) -> None:
        super().__init__()
        self.input_layernorm = ResidualLayerNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp, window)
        if config.qk_norm:  # LayerNorms of one head's width (weights and biases), not RMSNorms
            self.self_attn.q_norm = ResidualLayerNorm(config.head_dim, config.rms_norm_eps)
            self.self_attn.k_norm = ResidualLayerNorm(config.head_dim, config.rms_norm_eps)
        self.mlp = UngatedMLP(config.architecture, config.hidden_size, config.intermediate_size, config.mlp_bias,
                              config.hidden_act, tp)
        self.local_rope = False

    def forward(self, stream: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                kv_cache: torch.Tensor, backend: AttentionBackend[Any], metadata: Any,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream after this layer (of ``rows`` only, where given: every row's
        K and V still go into the cache)."""
        normed = self.input_layernorm(stream)
        attended = self.self_attn(normed, rotary, batch, kv_cache, backend, metadata, rows)
        if rows is not None:
            normed, stream = normed[rows], stream[rows]
        return attended + self.mlp(normed) + stream


class PhiForCausalLM(StreamLayersForCausalLM):
    checkpoint_renames = _RENAMES
    has_score_head = False  # no Phi sequence classifier is read
    layer_class = PhiDecoderLayer
    norm_class = ResidualLayerNorm  # final_layernorm

    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__(config, max_positions, tp)
        # Phi's output head has a bias, its own even where its weight is the embedding (tied):
        # an untied head's rows (this rank's share of the vocabulary) each have theirs; a tied
        # head's bias is the whole vocabulary's, added once the logits are gathered (rank 0).
        self.tied_head_bias: nn.Parameter | None = None
        if self.lm_head is not None:
            self.lm_head = nn.Linear(config.hidden_size, self.embed_tokens.weight.shape[0], bias=True)
        else:
            self.tied_head_bias = nn.Parameter(torch.zeros(config.vocab_size))

    def weight_slice(self, hf_name: str) -> TensorSlice | None:
        if self.tied_head_bias is not None and hf_name == "lm_head.bias":  # the whole vocabulary's, every rank's
            return None
        return super().weight_slice(hf_name)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.tied_head_bias is None or not self.tp.is_first:  # the other ranks' logits are not read
            return logits
        return logits + self.tied_head_bias.to(logits.dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        renames = self.checkpoint_renames + ((("lm_head.bias", "tied_head_bias"),) if self.tied_head_bias is not None
                                             else ())
        super().load_weights(renamed(weights, renames))
