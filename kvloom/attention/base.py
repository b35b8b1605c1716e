"""The attention-backend seam.

A backend writes the step's new K/V into the paged pool (through the slot mapping)
and attends each request's queries over its block table. The pool only knows block
ids; how a block's slots are arranged inside it is the backend's choice (``write_kv``
/ ``read_kv``): token-major by default, a kernel-friendly order for ``cpu_paged``.
Backends are chosen by name in ``attention/registry.py``.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any, Generic, TypeVar

import torch

from kvloom.batch import ForwardBatch

# What ``prepare`` builds once per step and every layer's ``forward`` receives.
MetadataT = TypeVar("MetadataT")


class AttentionBackend(ABC, Generic[MetadataT]):
    name: str = ""
    # Whether ``forward`` takes attention sinks (GPT-OSS's); a model with them is refused
    # by name on a backend without (attention/registry.py).
    supports_sinks: bool = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        # Gemma 2's attention logit softcapping: each scaled score s becomes
        # softcap * tanh(s / softcap) before the softmax; 0: none.
        self.softcap = 0.0

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> MetadataT:
        """Per-step metadata shared by all layers (masks, index tensors)."""

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store the step's k/v ([tokens, kv_heads, head_dim]) in their slots. Default:
        token-major blocks, [block_size, kv_heads, head_dim] each."""
        write_token_major(kv_cache, k, v, slot_mapping)

    def read_kv(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V held in the given slots, [slots, kv_heads, head_dim] each: the
        inverse of ``write_kv`` (for tests and debugging; not on the hot path)."""
        _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
        flat = kv_cache.view(2, num_blocks * block_size, kv_heads, head_dim)
        return flat[0, slot_mapping], flat[1, slot_mapping]

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                kv_cache: torch.Tensor, batch: ForwardBatch, metadata: MetadataT, window: int = 0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] (v None for
        latent attention, whose value is part of its key: attention/mla_ref.py);
        kv_cache: this layer's [2, num_blocks, block_size, kv_heads, head_dim] (the
        arrangement inside a block is this backend's, see ``write_kv``). ``window`` > 0:
        the layer's sliding window, the query at position p attending to keys
        (p - window, p]; 0: every key up to p. ``sinks`` ([heads] float32, only where
        ``supports_sinks``): GPT-OSS's attention sinks, one logit per head that joins
        the softmax's denominator with no value (exp(sink) added to the sum: the
        weights of the real keys sum to less than one). Returns [tokens, heads, head_dim]."""


def write_token_major(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Scatter the step's K/V into their slots of token-major blocks. Slots of different
    requests never overlap (each request writes only into blocks it owns privately)."""
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def import_library(package: str, install: str, backend: str) -> Any:
    """The kernel library an optional backend wraps, or a ValueError saying how to get it."""
    try:
        return importlib.import_module(package)
    except ImportError as error:
        raise ValueError(f"attention_backend {backend!r} needs the {package} package ({install}): {error}") from None
