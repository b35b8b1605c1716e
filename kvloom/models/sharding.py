"""Tensor-parallel sharding of the Llama family (Megatron's split): what each rank
holds and which part of each checkpoint tensor it reads.

- column-parallel (the output features split): the fused QKV (by heads: rank r holds
  query heads and KV heads ``r``-th of each) and the fused gate/up (by intermediate
  features); no communication, each rank computes its own heads and features;
- row-parallel (the input features split): the output projection and the down
  projection; each rank's product is a partial sum, all-reduced once per layer;
- vocabulary-parallel: the embedding table and the output head split by token id
  (padded to a multiple of the ranks); a lookup is a masked local lookup plus an
  all-reduce, the logits are the ranks' columns gathered on rank 0;
- replicated: the norms, and a row-parallel layer's bias, added on rank 0 only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvloom.config import ModelConfig


@dataclass(frozen=True)
class TensorSlice:
    """The part ``[start, end)`` along ``dim`` of a checkpoint tensor that one rank reads."""

    dim: int
    start: int
    end: int


def tensor_parallel_problem(config: ModelConfig, size: int) -> str | None:
    """Why ``config`` cannot be split across ``size`` ranks, or None. Heads, KV heads
    and intermediate features must divide evenly (the vocabulary is padded instead)."""
    if size == 1:
        return None
    sizes = {"num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
             "intermediate_size": config.intermediate_size}
    bad = [f"{name} ({value})" for name, value in sizes.items() if value % size]
    if bad:
        return (f"tensor_parallel_size={size} must divide the model's {' and '.join(bad)}: "
                f"each rank holds an equal share of the heads and features; try a size that "
                f"divides {config.num_heads} heads and {config.num_kv_heads} KV heads")
    return None


def rank_view(config: ModelConfig, size: int) -> ModelConfig:
    """The shapes one rank of ``size`` holds: its heads, KV heads and intermediate
    features (what its KV pool and attention backend are sized by)."""
    if size == 1:
        return config
    return dataclasses.replace(config, num_heads=config.num_heads // size,
                               num_kv_heads=config.num_kv_heads // size,
                               intermediate_size=config.intermediate_size // size)


def column_split(total: int, rank: int, size: int) -> tuple[int, int]:
    """``[start, end)`` of rank's equal part of ``total`` (a multiple of ``size``)."""
    part = total // size
    return rank * part, (rank + 1) * part


def vocab_split(vocab_size: int, rank: int, size: int) -> tuple[int, int, int]:
    """``(start, end, rows)``: the rank's token ids of a vocabulary padded to ``size``
    parts of ``rows`` each (the last part may hold fewer real ids than ``rows``)."""
    rows = -(-vocab_size // size)
    start = min(rank * rows, vocab_size)
    return start, min(start + rows, vocab_size), rows


def llama_weight_slice(config: ModelConfig, hf_name: str, rank: int, size: int) -> TensorSlice | None:
    """The part of checkpoint tensor ``hf_name`` that ``rank`` of ``size`` reads, or None
    for the whole tensor (replicated: norms, row-parallel biases)."""
    if size == 1:
        return None
    name = hf_name.removeprefix("model.")
    head_dim = config.head_dim
    if ".self_attn.q_proj." in name:
        return TensorSlice(0, *column_split(config.num_heads * head_dim, rank, size))
    if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
        return TensorSlice(0, *column_split(config.num_kv_heads * head_dim, rank, size))
    if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
        return TensorSlice(0, *column_split(config.intermediate_size, rank, size))
    if name.endswith(".self_attn.o_proj.weight"):
        return TensorSlice(1, *column_split(config.num_heads * head_dim, rank, size))
    if name.endswith(".mlp.down_proj.weight"):
        return TensorSlice(1, *column_split(config.intermediate_size, rank, size))
    if name in ("embed_tokens.weight", "lm_head.weight"):
        start, end, _ = vocab_split(config.vocab_size, rank, size)
        return TensorSlice(0, start, end)
    return None
