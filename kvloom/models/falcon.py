"""TII's Falcon (``FalconForCausalLM``: Falcon-7B, Falcon-40B / 180B, Falcon2-11B): LayerNorms
with biases, Llama's attention (no biases unless ``bias``) with the standard rotary, an un-gated
exact-GELU MLP (dense_h_to_4h, dense_4h_to_h), the embedding as the output head. Its layers:

- ``parallel_attn`` (Falcon-7B) or ``new_decoder_architecture`` (40B, 180B, 11B): attention and
  MLP side by side, added together and then to the stream (MLP + attention + stream); the MLP
  reads the attention's LayerNorm (one norm: ``num_ln_in_parallel_attn`` 1) or its own
  (``ln_mlp``: two, the new architecture's default);
- else the blocks in turn: GPT-NeoX's layer (``gpt_neox.GPTNeoXDecoderLayer``) in each case.

q, k and v are fused in the checkpoint: [q | k | v] with one KV head (``multi_query``), grouped
per KV head ([group][its queries | k | v]) in the new architecture, per head ([head][q | k | v])
otherwise; put in kvloom's [q | k | v] order at load (``fused_qkv_rows``). ALiBi models
(Falcon-RW) are refused by name (config.py).

The native walk runs its layers; tensor parallel where the KV heads split (not Falcon-7B's one).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvloom.models.gpt_neox import GPTNeoXDecoderLayer
from kvloom.models.layers import ResidualLayerNorm
from kvloom.models.llama import StreamLayersForCausalLM
from kvloom.models.weights import qkv_from_groups, renamed

# Checkpoint names -> the Llama modules that hold them (the new architecture's two norms are
# GPT-NeoX's input and post-attention ones).
_RENAMES = (("transformer.h.", "model.layers."), ("transformer.word_embeddings.", "model.embed_tokens."),
            ("transformer.ln_f.", "model.norm."), ("self_attention.query_key_value.", "self_attn.qkv_proj."),
            ("self_attention.dense.", "self_attn.o_proj."), ("mlp.dense_h_to_4h.", "mlp.fc1."),
            ("mlp.dense_4h_to_h.", "mlp.fc2."), ("ln_attn.", "input_layernorm."),
            ("ln_mlp.", "post_attention_layernorm."))


class FalconForCausalLM(StreamLayersForCausalLM):
    has_score_head = False  # no Falcon sequence classifier is read
    checkpoint_renames = _RENAMES
    layer_class = GPTNeoXDecoderLayer  # side by side on two norms or one (config.parallel_norms), or in turn
    norm_class = ResidualLayerNorm  # ln_f

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._in_our_order(renamed(weights, _RENAMES)))

    def _in_our_order(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            yield name, (self.fused_qkv_rows(tensor) if ".self_attn.qkv_proj." in name else tensor)

    def fused_qkv_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The checkpoint's q/k/v rows, grouped per KV head ([group][its queries | k | v]: the
        new architecture's; per head, a group of one, without it; one group, [q | k | v]
        already, with multi_query), in kvloom's [q | k | v]."""
        config = self.config
        return qkv_from_groups(rows, config.num_heads, config.num_kv_heads, config.head_dim)
