"""Stability AI's StableLM (``StableLmForCausalLM``: StableLM-3B-4E1T, StableLM 2 1.6B and 12B,
Zephyr): Llama's attention and gated SiLU MLP with LayerNorms (weights and biases), the rotary
on the first ``partial_rotary_factor`` of each head, q/k/v biases where ``use_qkv_bias``; with
``qk_layernorm`` each query and key head LayerNormed (its own weights, no bias) before the
rotary; with ``use_parallel_residual`` (StableLM 2 12B) attention and MLP both read the input
norm's output and are added to the stream together (stream + attention + MLP, transformers'
order), otherwise one after the other, as Llama.

The native walk runs its layers (side by side or in turn: ``parallel``, the attention's output
added into the stream first) but with ``qk_layernorm`` (LayerNorms of heads: modules); tensor
parallel too (each rank holds its heads' norms).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from kvloom.attention.base import AttentionBackend
from kvloom.batch import ForwardBatch
from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.models.layers import GatedMLP, ResidualLayerNorm
from kvloom.models.llama import LlamaAttention, StreamLayersForCausalLM
from kvloom.models.sharding import column_split

# One head's norm of the query or key LayerNorms: ...self_attn.{q,k}_layernorm.norms.<head>.weight
_HEAD_NORM = re.compile(r"(.*\.self_attn\.)([qk])_layernorm\.norms\.(\d+)\.weight")


class PerHeadLayerNorm(nn.Module):
    """A LayerNorm (no bias) of each head with that head's own weights: rows of ``heads *
    head_dim`` (a token's whole projection), each head normed over its ``head_dim``."""

    def __init__(self, num_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.eps = num_heads, head_dim, eps
        self.weight = nn.Parameter(torch.ones(num_heads * head_dim))  # head by head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = x.view(*x.shape[:-1], self.num_heads, self.head_dim)
        normed = torch.nn.functional.layer_norm(heads, (self.head_dim,), None, None, self.eps)
        return (normed * self.weight.view(self.num_heads, self.head_dim)).view(x.shape)


class StableLmDecoderLayer(nn.Module):
    parallel_adds = "stream_first"  # side by side: stream + attention, then + MLP (the native walk reads it)
    # Cohere's layer (models/cohere.py) is this one always side by side, its LayerNorms without biases.
    always_parallel = False
    norm_biases = True

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE_PROCESS, index: int = 0,
                 window: int = 0) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"{config.architecture}: hidden_act {config.hidden_act!r} is not supported "
                             "(supported: silu)")
        self.parallel = self.always_parallel or config.parallel_residual
        self.input_layernorm = ResidualLayerNorm(config.hidden_size, config.rms_norm_eps, bias=self.norm_biases)
        self.self_attn = LlamaAttention(config, tp, window)
        if config.qk_norm:  # this rank's heads' (all of them in one process)
            attention, head_dim = self.self_attn, config.head_dim
            self.self_attn.q_norm = PerHeadLayerNorm(attention.q_size // head_dim, head_dim, config.rms_norm_eps)
            self.self_attn.k_norm = PerHeadLayerNorm(attention.kv_size // head_dim, head_dim, config.rms_norm_eps)
        # One norm for both blocks where they run side by side (the checkpoint has no second).
        self.post_attention_layernorm = (None if self.parallel else
                                         ResidualLayerNorm(config.hidden_size, config.rms_norm_eps,
                                                           bias=self.norm_biases))
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, tp)
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
        if self.post_attention_layernorm is None:
            return stream + attended + self.mlp(normed)
        stream = stream + attended
        return stream + self.mlp(self.post_attention_layernorm(stream))


class StableLmForCausalLM(StreamLayersForCausalLM):
    has_score_head = False  # no StableLM sequence classifier is read
    layer_class = StableLmDecoderLayer
    norm_class = ResidualLayerNorm

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._head_norms_joined(weights))

    def _head_norms_joined(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each layer's per-head query (key) norm weights, one tensor a head in the
        checkpoint, as one q_norm (k_norm) weight, head by head, once every head is read
        (a head missing leaves the weight unset: the load then names it); under tensor
        parallel this rank's heads' alone, as its q (k) projection holds them."""
        heads = {"q": self.config.num_heads, "k": self.config.num_kv_heads}
        rank, size = self.tp.rank, self.tp.size
        pending: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in weights:
            match = _HEAD_NORM.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            prefix, which, head = match.groups()
            joined = f"{prefix}{which}_norm.weight"
            parts = pending.setdefault(joined, {})
            parts[int(head)] = tensor
            if len(parts) == heads[which] and sorted(parts) == list(range(heads[which])):
                first, last = column_split(heads[which], rank, size)
                yield joined, torch.cat([parts[h] for h in range(first, last)])
                del pending[joined]
