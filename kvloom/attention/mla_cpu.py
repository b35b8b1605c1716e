"""Latent attention (DeepSeek's MLA) on CPUs through the C++ kernel
(kvloom/csrc/latent_attention.cpp, the op ``kvloom::latent_attention``): every request's
queries, decodes, chunks and fresh prompts alike, in one call per layer that reads the
latents through the block tables. Each tile of 16 keys is widened to float32 once and
serves every head of the request (there is one KV "head"), where the PyTorch backends
(attention/mla_ref.py) gathered each request's latents and ran batched matmuls over them.

A query's result is the same bits whatever its step holds (the kernel's invariant), so a
request's tokens do not depend on its batch, chunking or prefix hits; against the
reference it agrees to float32 rounding (the reference's bf16 matmuls round scores and
weights to bf16; the kernel keeps them in float32). The pool stays token-major, written
as the reference writes it. Tensors the kernel does not take (float16, not on the CPU)
go to ``MLABatchedBackend`` (its metadata built per layer there: not a fast path).
"""

from __future__ import annotations

import torch

from kvloom.attention.base import AttentionBackend
from kvloom.attention.cpu_paged import KernelRows
from kvloom.attention.mla_ref import MLABatchedBackend, no_window
from kvloom.batch import ForwardBatch
from kvloom.kernels import latent_attention as kernels
from kvloom.native import KernelUnavailable

__all__ = ["KernelUnavailable", "MLACPUBackend"]


class MLACPUBackend(AttentionBackend[KernelRows]):
    name = "mla_cpu"

    def __init__(self, num_heads: int, latent_dim: int, value_dim: int, scale: float) -> None:
        super().__init__(num_heads, 1, latent_dim)
        if not kernels.available():
            raise KernelUnavailable("kvloom/csrc/latent_attention.cpp could not be built here (see the log)")
        self.value_dim = value_dim
        self.scale = scale  # the model's (qk_head_dim ** -0.5, YaRN-adjusted), not latent_dim's
        self.fallback = MLABatchedBackend(num_heads, latent_dim, value_dim, scale)

    def prepare(self, batch: ForwardBatch) -> KernelRows:
        """The kernel's arrays of every request, once per step (not per layer)."""
        return KernelRows.every(batch)

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                 slot_mapping: torch.Tensor) -> None:
        self.fallback.write_kv(kv_cache, k, v, slot_mapping)

    def read_kv(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fallback.read_kv(kv_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                kv_cache: torch.Tensor, batch: ForwardBatch, metadata: KernelRows,
                window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [tokens, heads, latent_dim] (absorbed); k: the step's latents [tokens, 1,
        latent_dim]. Returns [tokens, heads, value_dim], in latent space."""
        no_window(window)
        if not (kv_cache.is_cpu and kv_cache.dtype in kernels.ACTIVATIONS and q.dtype is kv_cache.dtype):
            return self.fallback.forward(q, k, v, kv_cache, batch, self.fallback.prepare(batch))
        self.write_kv(kv_cache, k, None, batch.slot_mapping)
        return kernels.latent_attention(q.contiguous(), kv_cache, metadata.block_tables, metadata.seq_lens,
                                        metadata.query_start, metadata.query_lens, self.value_dim, self.scale)
