"""EleutherAI's GPT-NeoX (``GPTNeoXForCausalLM``: Pythia, GPT-NeoX-20B): each layer norms the
stream twice, once for the attention and once for the MLP (LayerNorms with biases); with
``use_parallel_residual`` (the default) both read the same stream and are added to it
together (MLP + attention + stream, transformers' order), without it the MLP reads the
stream after the attention's add. The attention is Llama's with biases (q, k and v fused
per head in the checkpoint: [head][q | k | v], reordered into kvloom's [q | k | v] once at
load), the rotary on the first ``rotary_pct`` of each head; the MLP is un-gated
(dense_h_to_4h, GELU, dense_4h_to_h); the output head (``embed_out``) has no bias.

The native walk runs its layers (side by side or in turn: ``parallel``); tensor parallel
too (side by side: the modules, each block all-reduced before the add).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from kvloom.attention.base import AttentionBackend
from kvloom.batch import ForwardBatch
from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.models.layers import ResidualLayerNorm, UngatedMLP
from kvloom.models.llama import LlamaAttention, StreamLayersForCausalLM
from kvloom.models.weights import qkv_from_groups, renamed

# Checkpoint names -> the Llama modules that hold them.
_RENAMES = (("gpt_neox.", "model."), ("embed_in.", "embed_tokens."), ("final_layer_norm.", "norm."),
            ("embed_out.", "lm_head."), ("attention.query_key_value.", "self_attn.qkv_proj."),
            ("attention.dense.", "self_attn.o_proj."), ("mlp.dense_h_to_4h.", "mlp.fc1."),
            ("mlp.dense_4h_to_h.", "mlp.fc2."))
# Buffers that older checkpoints saved beside the weights (the causal mask, the rotary's).
_BUFFERS = ("attention.bias", "attention.masked_bias", "rotary_emb.inv_freq")


class GPTNeoXDecoderLayer(nn.Module):
    """A LayerNorm before the attention and one before the MLP (``layers.UngatedMLP``), the two
    blocks added to the stream together (``config.parallel_residual``: MLP + attention + stream)
    or in turn: GPT-2's, OPT's and Falcon's layer too (GPT-2's and OPT's attention turns no
    rotary: ``rotary`` None). Side by side with ``config.parallel_norms`` 1 (Falcon-7B's) the
    MLP reads the attention's norm and has none of its own."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE_PROCESS, index: int = 0,
                 window: int = 0) -> None:
        super().__init__()
        self.parallel = config.parallel_residual
        self.input_layernorm = ResidualLayerNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp, window)
        # (The walk reads its absence as Phi's layer: the MLP on the attention's normed input.)
        own_norm = not self.parallel or config.parallel_norms == 2
        self.post_attention_layernorm = (ResidualLayerNorm(config.hidden_size, config.rms_norm_eps) if own_norm
                                         else None)
        self.mlp = UngatedMLP(config.architecture, config.hidden_size, config.intermediate_size, config.mlp_bias,
                              config.hidden_act, tp)
        self.local_rope = False

    def forward(self, stream: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None, batch: ForwardBatch,
                kv_cache: torch.Tensor, backend: AttentionBackend[Any], metadata: Any,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream after this layer (of ``rows`` only, where given: every row's
        K and V still go into the cache)."""
        normed = self.input_layernorm(stream)
        attended = self.self_attn(normed, rotary, batch, kv_cache, backend, metadata, rows)
        if rows is not None:
            stream = stream[rows]
        if self.post_attention_layernorm is None:  # side by side on one norm
            return self.mlp(normed if rows is None else normed[rows]) + attended + stream
        if self.parallel:
            return self.mlp(self.post_attention_layernorm(stream)) + attended + stream
        stream = attended + stream
        return self.mlp(self.post_attention_layernorm(stream)) + stream


class GPTNeoXForCausalLM(StreamLayersForCausalLM):
    checkpoint_renames = _RENAMES
    has_score_head = False  # no GPT-NeoX sequence classifier is read
    layer_class = GPTNeoXDecoderLayer
    norm_class = ResidualLayerNorm  # final_layer_norm

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._fused_in_our_order(renamed(weights, _RENAMES)))

    def _fused_in_our_order(self, weights: Iterable[tuple[str, torch.Tensor]]
                            ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with q/k/v in kvloom's order (``fused_qkv_rows``); old
        buffers skipped."""
        for name, tensor in weights:
            if name.endswith(_BUFFERS):
                continue
            yield name, (self.fused_qkv_rows(tensor) if ".self_attn.qkv_proj." in name else tensor)

    def fused_qkv_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The checkpoint's q/k/v rows, grouped per head ([head][q | k | v]), as kvloom's
        fused projection holds them ([q | k | v], each head by head)."""
        config = self.config
        return qkv_from_groups(rows, config.num_heads, config.num_kv_heads, config.head_dim)
