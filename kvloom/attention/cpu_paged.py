"""CPU attention that reads K/V through the block table (no per-sequence gather).

Two paths, chosen per sequence once per step in ``prepare``:
- a prefill chunk that starts at position 0 has all its keys in this step's k/v, so
  it runs PyTorch's fused causal SDPA on them directly (blocked GEMMs, fastest);
- everything else (decodes, chunked-prefill continuations, prefix-cache hits) runs
  the C++ kernel in ``kvloom/csrc/paged_attention.cpp``, which walks the block table.

The kernel is compiled on first use (kvloom/native.py: about a second, plain C ABI
through ctypes, no torch headers) and cached under ``$KVLOOM_HOME/kernels``.
Both paths are tested against ``torch_ref`` (tests/attention).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvloom import native
from kvloom.attention.base import AttentionBackend, write_kv
from kvloom.native import KernelUnavailable
from kvloom.runner.forward_batch import ForwardBatch

__all__ = ["CPUPagedBackend", "KernelUnavailable", "load_library"]


def load_library() -> ctypes.CDLL:
    """Build (once) and load ``csrc/paged_attention.cpp``, with its signatures set."""
    library = native.load("paged_attention")
    for name in ("kvloom_paged_attention_f32", "kvloom_paged_attention_bf16"):
        function = getattr(library, name)
        function.restype = None
        function.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_void_p, ctypes.c_int64]
                             + [ctypes.c_void_p] * 3
                             + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int])
    return library


@dataclass(slots=True)
class CPUPagedMetadata:
    """Per-step split of the batch, shared by every layer."""

    fresh: list[tuple[int, int]]  # (first token row, length) of prefills starting at 0
    kernel_rows: int  # sequences handled by the kernel
    block_tables: torch.Tensor  # [kernel_rows, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [kernel_rows] int32
    query_start: torch.Tensor  # [kernel_rows] int32: first token row of each sequence
    query_lens: torch.Tensor  # [kernel_rows] int32


class CPUPagedBackend(AttentionBackend):
    name = "cpu_paged"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        library = load_library()
        self._kernels = {torch.float32: library.kvloom_paged_attention_f32,
                         torch.bfloat16: library.kvloom_paged_attention_bf16}

    def prepare(self, batch: ForwardBatch) -> CPUPagedMetadata:
        fresh, rows, starts, lens, seqs = [], [], [], [], []
        start = 0
        for index, (query_len, seq_len) in enumerate(zip(batch.query_lens_list, batch.seq_lens_list, strict=True)):
            if query_len == seq_len and query_len > 1:
                fresh.append((start, query_len))
            else:
                rows.append(index)
                starts.append(start)
                lens.append(query_len)
                seqs.append(seq_len)
            start += query_len
        select = torch.tensor(rows, dtype=torch.int64)
        return CPUPagedMetadata(
            fresh=fresh, kernel_rows=len(rows),
            block_tables=batch.block_tables.index_select(0, select).contiguous(),
            seq_lens=torch.tensor(seqs, dtype=torch.int32),
            query_start=torch.tensor(starts, dtype=torch.int32),
            query_lens=torch.tensor(lens, dtype=torch.int32),
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, batch: ForwardBatch, metadata: object) -> torch.Tensor:
        assert isinstance(metadata, CPUPagedMetadata)
        write_kv(kv_cache, k, v, batch.slot_mapping)
        q = q.contiguous()
        out = torch.empty_like(q)
        if metadata.kernel_rows:
            kernel = self._kernels[q.dtype]
            kernel(q.data_ptr(), out.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                   metadata.block_tables.data_ptr(), metadata.block_tables.shape[1],
                   metadata.seq_lens.data_ptr(), metadata.query_start.data_ptr(),
                   metadata.query_lens.data_ptr(), metadata.kernel_rows, self.num_heads,
                   self.num_kv_heads, self.head_dim, batch.block_size, self.scale,
                   torch.get_num_threads())
        for start, length in metadata.fresh:
            # [1, heads, length, head_dim] views of this step's own q/k/v.
            q_i = q[start:start + length].transpose(0, 1).unsqueeze(0)
            k_i = k[start:start + length].transpose(0, 1).unsqueeze(0)
            v_i = v[start:start + length].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q_i, k_i, v_i, is_causal=True, scale=self.scale,
                                               enable_gqa=self.num_heads != self.num_kv_heads)
            out[start:start + length] = o.squeeze(0).transpose(0, 1)
        return out
