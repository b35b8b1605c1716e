"""``WeightFiller``: checkpoint tensors copied into a model's parameters and counted,
so that a name the model does not have, a tensor of the wrong shape and a parameter
left (partly) unset are each refused with the name. The models' ``load_weights`` map
HF names to their parameters; this is the bookkeeping they share."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

import numpy as np
import torch
from torch import nn


def renamed(weights: Iterable[tuple[str, torch.Tensor]], renames: tuple[tuple[str, str], ...]
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors under the names of the (Llama) modules that hold them (``rename``)."""
    for name, tensor in weights:
        yield rename(name, renames), tensor


def rename(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """A checkpoint's name as kvloom's modules know it: each ``(theirs, ours)`` fragment
    replaced in order (a family's names, e.g. Phi's ``dense``)."""
    for theirs, ours in renames:
        name = name.replace(theirs, ours)
    return name


Rows = TypeVar("Rows", torch.Tensor, np.ndarray)


def halves_from_pairs(rows: Rows, num_heads: int, rotary_dim: int | None = None) -> Rows:
    """A query or key projection's rows (a weight's or a bias's; a tensor or an array) for a
    rotary that turns adjacent pairs (2i, 2i + 1) of each head (GLM's, ERNIE 4.5's, and
    llama.cpp's order of Llama's rows), regrouped so that Llama's rotary, which turns
    (i, i + rotary_dim / 2), turns the same pairs by the same angles: row i of a head is its
    old row 2i, row rotary_dim / 2 + i its old row 2i + 1. Queries and keys move alike, so
    every score is the same dot product. ``rotary_dim``: the rows of each head the rotary
    turns (its first ones, GLM's half; None: all), the rest left in place. Returns a new,
    contiguous copy."""
    head = rows.shape[0] // num_heads
    turned = head if rotary_dim is None else rotary_dim
    # [heads, head, in]: the turned rows [heads, turned / 2, 2, in] -> [heads, 2, turned / 2, in]
    grouped = rows.reshape(num_heads, head, -1)
    pairs = grouped[:, :turned].reshape(num_heads, turned // 2, 2, -1).swapaxes(1, 2).reshape(num_heads, turned, -1)
    if turned == head:
        return pairs.reshape(rows.shape)  # (the reshapes copy)
    out = grouped.copy() if isinstance(grouped, np.ndarray) else grouped.clone()
    out[:, :turned] = pairs
    return out.reshape(rows.shape)


def qkv_from_groups(rows: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """A fused q/k/v projection's rows (a weight's, a bias's or a LoRA B's) grouped per KV
    head, [group][its queries | its key | its value] (Falcon's new architecture; a group a head,
    [head][q | k | v], for GPT-NeoX and for Falcon and GPTBigCode without multi-query; one group,
    [q | k | v] already, with it), in kvloom's [q | k | v] order. Returns a new tensor."""
    grouped = rows.reshape(num_kv_heads, num_heads // num_kv_heads + 2, head_dim, -1)
    q = grouped[:, :-2].reshape(num_heads * head_dim, -1)
    k = grouped[:, -2].reshape(num_kv_heads * head_dim, -1)
    v = grouped[:, -1].reshape(num_kv_heads * head_dim, -1)
    return torch.cat((q, k, v)).reshape(rows.shape)


class WeightFiller:
    def __init__(self, model: nn.Module) -> None:
        self.params = dict(model.named_parameters())
        self.filled: dict[str, int] = {}  # parameter -> elements copied into it

    def __contains__(self, target: str) -> bool:
        return target in self.params

    def copy(self, target: str, tensor: torch.Tensor, hf_name: str, rows: slice | None = None) -> None:
        """Checkpoint tensor ``hf_name`` into parameter ``target`` (its ``rows`` only)."""
        if target not in self.params:
            raise ValueError(f"checkpoint has an unexpected tensor {hf_name!r}")
        dest = self.params[target].data if rows is None else self.params[target].data[rows]
        if dest.shape != tensor.shape:
            raise ValueError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        self.count(target, tensor.numel())

    def count(self, target: str, elements: int) -> None:
        """Elements of ``target`` filled elsewhere (a module's own loader)."""
        self.filled[target] = self.filled.get(target, 0) + elements

    def finish_shard(self, padding: int, vocabulary: tuple[str, ...], rank: int) -> None:
        """What a tensor-parallel rank's shard holds beyond the checkpoint's numbers: the
        vocabulary tables' padding rows (``padding`` zeros each, counted as filled for the
        ``vocabulary`` parameters read), and, on ranks past 0, the row-parallel projections'
        biases zeroed (o, down, an un-gated MLP's fc2: rank 0 adds each once)."""
        for name in vocabulary:
            if name in self.filled:
                self.count(name, padding)
        if rank > 0:
            for name, param in self.params.items():
                if name.endswith(("o_proj.bias", "down_proj.bias", "fc2.bias")):
                    param.data.zero_()

    def check_complete(self) -> None:
        missing = [n for n, p in self.params.items() if self.filled.get(n, 0) != p.numel()]
        if missing:
            raise ValueError(f"checkpoint is missing tensors for {missing[:5]}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
