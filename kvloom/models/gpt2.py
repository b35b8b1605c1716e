"""OpenAI's GPT-2 (``GPT2LMHeadModel``): learned absolute positions added to the token
embeddings (no rotary), pre-LayerNorm layers (weights and biases; GPT-NeoX's layer, its blocks in turn, the
attention called with no rotary), Llama's attention with
biases (q, k and v fused as c_attn, in kvloom's [q | k | v] order already), an un-gated MLP
(c_fc, GELU's tanh form ``gelu_new``, c_proj), a final LayerNorm and the embedding as the
output head. Its checkpoints store every matmul as a Conv1D, [in, out]: transposed at load.

Refused by name: attention scaled otherwise than by head_dim ** -0.5
(``scale_attn_weights`` off, ``scale_attn_by_inverse_layer_idx`` on). The native walk runs
its layers (no rotary in any: its positions are in the embeddings); tensor
parallel too (``weight_slice`` turns the cut for the Conv1D weights).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kvloom.batch import ForwardBatch
from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.models.gpt_neox import GPTNeoXDecoderLayer
from kvloom.models.layers import ResidualLayerNorm
from kvloom.models.llama import StreamLayersForCausalLM
from kvloom.models.sharding import TensorSlice
from kvloom.models.weights import qkv_from_groups, rename, renamed

# Checkpoint names -> the Llama modules that hold them (the prefix first: "h." is short).
_RENAMES = (("transformer.h.", "model.layers."), ("transformer.", "model."), ("wte.", "embed_tokens."),
            ("wpe.", "embed_positions."), ("ln_1.", "input_layernorm."), ("ln_2.", "post_attention_layernorm."),
            ("attn.c_attn.", "self_attn.qkv_proj."), ("attn.c_proj.", "self_attn.o_proj."),
            ("mlp.c_fc.", "mlp.fc1."), ("mlp.c_proj.", "mlp.fc2."), ("ln_f.", "norm."))
_CONV1D = (".self_attn.qkv_proj.weight", ".self_attn.o_proj.weight", ".mlp.fc1.weight", ".mlp.fc2.weight")
# Buffers that older checkpoints saved beside the weights (the causal mask).
_BUFFERS = (".attn.bias", ".attn.masked_bias")


class GPT2LMHeadModel(StreamLayersForCausalLM):
    checkpoint_renames = _RENAMES
    has_score_head = False  # no GPT-2 sequence classifier is read
    layer_class = GPTNeoXDecoderLayer  # the same layer, its blocks in turn (no parallel residual)
    norm_class = ResidualLayerNorm  # ln_f

    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__(config, max_positions, tp)
        # Every position it was trained on has a row (a longer context has none to read).
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        return self.embed_tokens(batch.input_ids) + self.embed_positions(batch.positions)

    def weight_slice(self, hf_name: str) -> TensorSlice | None:
        """As Llama's, along the other dimension for a Conv1D weight ([in, out]: its output
        features are its columns)."""
        cut = super().weight_slice(hf_name)
        if cut is None or not rename(hf_name, _RENAMES).endswith(_CONV1D):
            return cut
        return TensorSlice(1 - cut.dim, cut.start, cut.end)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_as_linear(renamed(weights, _RENAMES)))


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    """BigCode's GPTBigCode (StarCoder, SantaCoder, WizardCoder 15B): GPT-2's model and names,
    its matmuls nn.Linear's ([out, in]: none transposed), its keys and values one head's for
    every query head where ``multi_query`` (the default: c_attn is [q | k | v] then, kvloom's
    order), else each head's q, k and v together in c_attn's rows (regrouped as GPT-NeoX's)."""

    def weight_slice(self, hf_name: str) -> TensorSlice | None:
        return StreamLayersForCausalLM.weight_slice(self, hf_name)  # nn.Linear's: Llama's cut

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        StreamLayersForCausalLM.load_weights(self, self._in_our_order(renamed(weights, _RENAMES)))

    def _in_our_order(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.endswith(_BUFFERS):
                continue
            yield name, (self.fused_qkv_rows(tensor) if ".self_attn.qkv_proj." in name else tensor)

    def fused_qkv_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """c_attn's rows as [q | k | v]: head by head ([head][q | k | v]) without multi_query,
        one group (that order already) with it."""
        config = self.config
        return qkv_from_groups(rows, config.num_heads, config.num_kv_heads, config.head_dim)


def _as_linear(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Conv1D weights ([in, out]) as nn.Linear's ([out, in]); saved masks skipped."""
    for name, tensor in weights:
        if name.endswith(_BUFFERS):
            continue
        yield name, (tensor.t() if name.endswith(_CONV1D) else tensor)
