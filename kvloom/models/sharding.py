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
- replicated: the norms, and a row-parallel layer's bias, added on rank 0 only;
- mixture of experts (models/moe.py): every expert's gate/up column-parallel and its
  down row-parallel, by its intermediate features (the shared expert's too); the
  router replicated; one all-reduce after the whole FFN.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from kvloom.config import ModelConfig
from kvloom.model_families import MoEConfig


@dataclass(frozen=True)
class TensorSlice:
    """The part ``[start, end)`` along ``dim`` of a checkpoint tensor that one rank reads."""

    dim: int
    start: int
    end: int


def tensor_parallel_problem(config: ModelConfig, size: int, expert_parallel: bool = False) -> str | None:
    """Why ``config`` cannot be split across ``size`` ranks, or None. Heads, KV heads
    and intermediate features (dense, each expert's, the shared expert's) must divide
    evenly (the vocabulary is padded instead); under ``expert_parallel`` the experts
    themselves instead of each one's features."""
    if size == 1:
        return None
    sizes = {"num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads}
    moe = config.moe
    if moe is None or len(moe.sparse_layers) < config.num_layers:  # some layer has the dense MLP
        sizes["intermediate_size"] = config.intermediate_size
    if moe is not None and expert_parallel:
        sizes["num_experts"] = moe.num_experts
    elif moe is not None:
        sizes["experts' intermediate size"] = moe.intermediate_size
        if moe.shared_expert_intermediate_size:
            sizes["shared expert's intermediate size"] = moe.shared_expert_intermediate_size
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


def llama_weight_slice(config: ModelConfig, hf_name: str, rank: int, size: int,
                       expert_parallel: bool = False) -> TensorSlice | None:
    """The part of checkpoint tensor ``hf_name`` that ``rank`` of ``size`` reads, or None
    for the whole tensor (replicated: norms, row-parallel biases); a mixture-of-experts
    block's as ``moe_weight_slice`` cuts it."""
    if size == 1:
        return None
    name = hf_name.removeprefix("model.")
    block = moe_block_name(name)
    if config.moe is not None and block is not None and config.moe.is_sparse(block[0]):
        return moe_weight_slice(config.moe, block[1], rank, size, expert_parallel)
    head_dim = config.head_dim
    if ".self_attn.q_proj." in name:
        return TensorSlice(0, *column_split(config.num_heads * head_dim, rank, size))
    if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
        return TensorSlice(0, *column_split(config.num_kv_heads * head_dim, rank, size))
    if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
        return TensorSlice(0, *column_split(config.intermediate_size, rank, size))
    if name.endswith(".self_attn.sinks"):  # a logit per query head (GPT-OSS's)
        return TensorSlice(0, *column_split(config.num_heads, rank, size))
    if name.endswith(".self_attn.o_proj.weight"):
        return TensorSlice(1, *column_split(config.num_heads * head_dim, rank, size))
    if name.endswith(".mlp.down_proj.weight"):
        return TensorSlice(1, *column_split(config.intermediate_size, rank, size))
    if ".mlp.fc1." in name:  # an un-gated MLP's (kvloom's names: a family's renames applied)
        return TensorSlice(0, *column_split(config.intermediate_size, rank, size))
    if name.endswith(".mlp.fc2.weight"):
        return TensorSlice(1, *column_split(config.intermediate_size, rank, size))
    if name in ("embed_tokens.weight", "lm_head.weight", "lm_head.bias"):  # Phi's and GPT-J's heads have a bias
        start, end, _ = vocab_split(config.vocab_size, rank, size)
        return TensorSlice(0, start, end)
    return None


def whole_norm_slice(config: ModelConfig, hf_name: str, rank: int, size: int) -> TensorSlice | None:
    """A q/k norm over the whole projection (OLMo 2's, OLMoE's: its weight one column per
    feature of every head): this rank's heads' columns; None for any other tensor."""
    if size == 1 or not hf_name.endswith((".self_attn.q_norm.weight", ".self_attn.k_norm.weight")):
        return None
    heads = config.num_heads if ".q_norm." in hf_name else config.num_kv_heads
    first, last = column_split(heads, rank, size)
    return TensorSlice(0, first * config.head_dim, last * config.head_dim)


def fused_rows(config: ModelConfig, name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """A rank's rows of a checkpoint tensor that fuses q/k/v (``self_attn.qkv_proj``) or
    gate/up (``mlp.gate_up_proj``), Phi-3's: each part's share, the parts in order, as
    the rank's own fused layer holds them (read whole, since the shares are not one range)."""
    if ".self_attn.qkv_proj." in name:
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        parts = [(0, q), (q, kv), (q + kv, kv)]
    else:
        parts = [(0, config.intermediate_size), (config.intermediate_size, config.intermediate_size)]
    return torch.cat([tensor[offset + start:offset + end]
                      for offset, total in parts for start, end in [column_split(total, rank, size)]])


# ---- mixture of experts: checkpoint names ----------------------------------------------
# Mixtral's hub names (w1 gate, w3 up, w2 down), Qwen2-MoE's and DeepSeek's, and the
# fused tensors of transformers 5's modules ([experts, 2 * inter, hidden] gate|up and
# [experts, hidden, inter] down; its save_pretrained writes the per-expert names back).
_BLOCK = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(.+)")
_EXPERT = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_SHARED = re.compile(r"shared_experts?\.(gate_proj|up_proj|down_proj)\.weight")
_EXPERT_PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_WHOLE = {"gate.weight": "router", "gate.e_score_correction_bias": "score_correction_bias",
          "experts.gate_up_proj": "gate_up", "experts.down_proj": "down", "shared_expert_gate.weight": "shared_gate",
          "experts.up_proj": "up",  # experts without a gate (Nemotron 3's): every expert's up, fused
          # GraniteMoe's hub names: the router, and every expert's gate|up and down in one tensor each
          "router.layer.weight": "router", "input_linear.weight": "gate_up", "output_linear.weight": "down",
          # GPT-OSS's: a router with a bias, the fused experts ([E, hidden, 2 * inter] gate and up
          # alternating; [E, inter, hidden] down) and their biases
          "router.weight": "router", "router.bias": "router_bias", "experts.gate_up_proj_bias": "gate_up_bias",
          "experts.down_proj_bias": "down_bias",
          # and its hub checkpoints' MXFP4 experts ([E, out, in / 32, 16] codes, [E, out, in / 32] scales)
          "experts.gate_up_proj_blocks": "gate_up_blocks", "experts.gate_up_proj_scales": "gate_up_scales",
          "experts.down_proj_blocks": "down_blocks", "experts.down_proj_scales": "down_scales"}


@dataclass(frozen=True)
class MoETensor:
    """What one checkpoint tensor of a MoE block holds. ``part``: ``router``,
    ``score_correction_bias``, ``router_bias``, ``gate`` / ``up`` / ``down`` (of ``expert``;
    ``gate_up`` and ``down`` with expert None: every expert's, fused), ``gate_up_bias`` /
    ``down_bias`` (every expert's, GPT-OSS's), ``shared_gate`` (the shared
    expert's sigmoid gate), ``shared_gate_proj`` / ``shared_up_proj`` / ``shared_down_proj``."""

    part: str
    expert: int | None = None


def moe_block_name(name: str) -> tuple[int, str] | None:
    """``(layer, name inside the FFN block)`` for ``layers.N.mlp.*`` and Mixtral's
    ``layers.N.block_sparse_moe.*`` (``model.`` already removed), else None."""
    match = _BLOCK.fullmatch(name)
    return None if match is None else (int(match.group(1)), match.group(2))


def moe_tensor(name: str) -> MoETensor | None:
    """What the tensor named ``name`` inside a MoE block holds, or None if it is none of its."""
    if name in _WHOLE:
        return MoETensor(_WHOLE[name])
    expert = _EXPERT.fullmatch(name)
    if expert is not None:
        return MoETensor(_EXPERT_PARTS[expert.group(2)], int(expert.group(1)))
    shared = _SHARED.fullmatch(name)
    return None if shared is None else MoETensor(f"shared_{shared.group(1)}")


def moe_weight_slice(moe: MoEConfig, name: str, rank: int, size: int,
                     expert_parallel: bool = False) -> TensorSlice | None:
    """The part of MoE-block tensor ``name`` that ``rank`` of ``size`` reads (None: all
    of it: the router, the bias, the shared gate, and the fused gate|up, whose two
    halves the module cuts itself). Under ``expert_parallel`` the rank's experts whole:
    the fused tensors' rows of them, an expert of its own whole, another's nothing (an
    empty range); the shared expert is cut by its features either way."""
    if size == 1:
        return None
    tensor = moe_tensor(name)
    if tensor is None:
        return None
    if expert_parallel and tensor.part in ("gate_up", "down", "gate", "up", "gate_up_bias", "down_bias",
                                           "gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"):
        first, last = column_split(moe.num_experts, rank, size)
        if tensor.expert is None:
            return TensorSlice(0, first, last)
        return None if first <= tensor.expert < last else TensorSlice(0, 0, 0)
    inter = column_split(moe.intermediate_size, rank, size)
    shared = column_split(moe.shared_expert_intermediate_size, rank, size)
    if tensor.expert is not None:  # one expert's [inter, hidden] gate/up or [hidden, inter] down
        return TensorSlice(1 if tensor.part == "down" else 0, *inter)
    if moe.gpt_oss_layout:  # read whole, cut by the module once in the other families' layout
        return None
    return {"down": TensorSlice(2, *inter), "up": TensorSlice(1, *inter), "shared_gate_proj": TensorSlice(0, *shared),
            "shared_up_proj": TensorSlice(0, *shared), "shared_down_proj": TensorSlice(1, *shared)}.get(tensor.part)
