"""The model side of LoRA: each adapted projection computes ``base(x)`` and adds, to
the rows of each adapter in the step, ``scale * (x A^T) B^T`` for every projection
that adapter targets (a fused projection, q|k|v or gate|up, adds each part's delta
to its own columns). Rows of the base model get nothing added.

The weights of every adapter slot sit in stacked tensors (``max_loras`` slots of rank
``max_lora_rank``; a smaller rank is zero-padded, which adds exact zeros); which rows
run which slot is the step's ``LoRAStep``, shared by every LoRA layer and set by the
runner around each forward. Pure PyTorch, in the model's dtype (as vLLM's): on any
device, and the reference for a fused kernel should one come.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(slots=True)
class LoRAStep:
    """The forward in progress: for each adapter slot in it, the rows that run it."""

    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def begin(self, seq_slots: list[int], query_lens: list[int], device: torch.device) -> None:
        """``seq_slots[i]``: the slot of the batch's sequence i (-1: the base model),
        whose ``query_lens[i]`` rows follow the sequences before it."""
        rows: dict[int, list[int]] = {}
        start = 0
        for slot, count in zip(seq_slots, query_lens, strict=True):
            if slot >= 0:
                rows.setdefault(slot, []).extend(range(start, start + count))
            start += count
        self.groups = [(slot, torch.tensor(r, dtype=torch.int64, device=device)) for slot, r in rows.items()]

    def end(self) -> None:
        self.groups = []


class LoRALinear(nn.Module):
    """A projection (packed or plain) with LoRA deltas for its ``parts``: (name, first
    output column, columns) each, one per unfused projection an adapter may target."""

    def __init__(self, base: nn.Module, parts: list[tuple[str, int, int]], in_features: int, max_loras: int,
                 max_rank: int, step: LoRAStep, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base = base
        self.parts = parts
        self.step = step
        self.a = [torch.zeros(max_loras, max_rank, in_features, dtype=dtype, device=device) for _ in parts]
        self.b = [torch.zeros(max_loras, size, max_rank, dtype=dtype, device=device) for _, _, size in parts]
        self.scale = [0.0] * max_loras
        self.targets: list[set[int]] = [set() for _ in range(max_loras)]  # the parts each slot adapts

    def load(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        rank = a.shape[0]
        self.a[part][slot].zero_()
        self.b[part][slot].zero_()
        self.a[part][slot, :rank].copy_(a)
        self.b[part][slot, :, :rank].copy_(b)
        self.scale[slot] = scale
        self.targets[slot].add(part)

    def clear(self, slot: int) -> None:
        self.targets[slot] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        for slot, rows in self.step.groups:
            parts = self.targets[slot]
            if not parts:
                continue
            xs = x[rows]
            for part in parts:
                _, start, size = self.parts[part]
                delta = (xs @ self.a[part][slot].T) @ self.b[part][slot].T
                y[rows, start:start + size] += delta * self.scale[slot]
        return y
