"""CPU attention that reads K/V through the block table (no per-sequence gather).

The C++ kernel in ``kvloom/csrc/paged_attention.cpp`` walks each sequence's block
table: decodes, chunked-prefill continuations, prefix-cache hits and fresh prefills,
all through the one kernel, so that a query's result never depends on how its
sequence was cut into steps (the exactness promise; PyTorch's SDPA for fresh prefills
gave other bits than the kernel for the same query later). The paired kernel is 2-3x
faster than SDPA; the token-major float one within 6% of it.

bf16 caches whose shape the kernel's paired paths serve (``paired_layout``:
head_dim 32/64/128/256, block_size a multiple of 16, on a CPU with AVX2 or AVX-512)
arrange each block for it: K as [kv_head, head_dim / 2, block_size] words of two
bf16 (a dim pair of one key), V as [kv_head, block_size / 2, head_dim] words (one
dim of a token pair), so the kernel's dot products read registers straight from the
block (see the kernel's comments). Other caches stay token-major.

The kernels are the ops ``kvloom::paged_attention`` and ``kvloom::write_kv_paired``
(kvloom/kernels/paged_attention.py: schemas, checks, fake tensors), compiled on first
use by kvloom/native.py (about a second, a plain C ABI called through ctypes, no torch
headers) and cached under ``$KVLOOM_HOME/kernels``.
Both paths are tested against ``torch_ref`` (tests/attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvloom.attention.base import AttentionBackend
from kvloom.batch import ForwardBatch
from kvloom.kernels import paged_attention as kernels
from kvloom.native import KernelUnavailable

__all__ = ["CPUPagedBackend", "KernelUnavailable", "load_library"]


def load_library() -> None:
    """Build (once) and load ``csrc/paged_attention.cpp``; KernelUnavailable where it cannot."""
    kernels.load()


@dataclass(slots=True)
class KernelRows:
    """The sequences one kernel call attends, as the kernel's int32 arrays."""

    count: int
    block_tables: torch.Tensor  # [count, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [count] int32
    query_start: torch.Tensor  # [count] int32: first token row of each sequence
    query_lens: torch.Tensor  # [count] int32

    @staticmethod
    def every(batch: ForwardBatch) -> KernelRows:
        """Every sequence of the step, each from its first row (its queries packed in order)."""
        starts = [0]
        for query_len in batch.query_lens_list[:-1]:
            starts.append(starts[-1] + query_len)
        return KernelRows.of(batch, list(range(len(starts))), starts)

    @staticmethod
    def of(batch: ForwardBatch, rows: list[int], starts: list[int]) -> KernelRows:
        tables = batch.block_tables
        if len(rows) != tables.shape[0]:
            tables = tables.index_select(0, torch.tensor(rows, dtype=torch.int64))
        return KernelRows(
            count=len(rows), block_tables=tables.contiguous(),
            seq_lens=torch.tensor([batch.seq_lens_list[i] for i in rows], dtype=torch.int32),
            query_start=torch.tensor(starts, dtype=torch.int32),
            query_lens=torch.tensor([batch.query_lens_list[i] for i in rows], dtype=torch.int32),
        )


@dataclass(slots=True)
class CPUPagedMetadata:
    """Per-step kernel arrays, shared by every layer."""

    every: KernelRows  # all sequences: fresh prefills, chunks and decodes alike


class CPUPagedBackend(AttentionBackend[CPUPagedMetadata]):
    name = "cpu_paged"
    supports_sinks = True  # every path of the kernel adds exp(sink) to its softmax's sum

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        load_library()
        self._paired_block_sizes: dict[int, bool] = {}

    def paired_layout(self, kv_cache: torch.Tensor) -> bool:
        """Whether this cache uses the paired layout (decided by the kernel's build)."""
        if kv_cache.dtype != torch.bfloat16:
            return False
        block_size = kv_cache.shape[2]
        if block_size not in self._paired_block_sizes:
            self._paired_block_sizes[block_size] = kernels.paired_layout(self.head_dim, block_size)
        return self._paired_block_sizes[block_size]

    def _paired_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K as [blocks, kv_heads, head_dim / 2, block_size, 2] and V as
        [blocks, kv_heads, block_size / 2, head_dim, 2]: the same memory, paired order."""
        _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
        keys = kv_cache[0].view(num_blocks, kv_heads, head_dim // 2, block_size, 2)
        values = kv_cache[1].view(num_blocks, kv_heads, block_size // 2, head_dim, 2)
        return keys, values

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        if not self.paired_layout(kv_cache):
            return super().write_kv(kv_cache, k, v, slot_mapping)
        k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
        if k.stride(2) != 1 or k.stride(1) != k.shape[2] or v.stride(2) != 1 or v.stride(1) != v.shape[2]:
            k, v = k.contiguous(), v.contiguous()  # tokens may be strided, a token's row not
        kernels.write_kv_paired(k, v, slot_mapping.to(torch.int64).contiguous(), kv_cache)

    def read_kv(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.paired_layout(kv_cache):
            return super().read_kv(kv_cache, slot_mapping)
        keys, values = self._paired_views(kv_cache)
        block_size = kv_cache.shape[2]
        block, offset = slot_mapping // block_size, slot_mapping % block_size
        k = keys[block, :, :, offset, :].flatten(2)  # [slots, kv_heads, head_dim]
        return k, values[block, :, offset // 2, :, offset % 2]

    def prepare(self, batch: ForwardBatch) -> CPUPagedMetadata:
        return CPUPagedMetadata(every=KernelRows.every(batch))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, batch: ForwardBatch, metadata: CPUPagedMetadata,
                window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        self.write_kv(kv_cache, k, v, batch.slot_mapping)
        # Every sequence goes through the kernel, fresh prefills too: a query's result is
        # then the same whether its sequence is prefilled whole, in chunks or token by
        # token (one fixed walk over its keys), which SDPA for fresh prefills broke.
        # The op checks q against the cache (a bf16 cache needs bf16 queries, ...).
        rows = metadata.every
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()  # the model's dtype; the kernel reads float32
        return kernels.paged_attention(q.contiguous(), kv_cache, rows.block_tables, rows.seq_lens,
                                       rows.query_start, rows.query_lens, self.scale, self.paired_layout(kv_cache),
                                       window, self.softcap, sinks)
