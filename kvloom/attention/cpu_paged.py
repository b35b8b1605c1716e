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
                             + [ctypes.c_void_p] * 5
                             + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int])
    return library


# A shared prefix is attended once for its whole group (two fp32 GEMMs per kv head)
# only where that beats the kernel re-reading it per sequence: enough sequences and
# enough blocks to amortise the gather and the merge (about a dozen torch ops a layer).
MIN_SHARED_SEQS = 4
MIN_SHARED_BLOCKS = 8
SHARED_SCORE_ELEMENTS = 1 << 20  # float32 scores per chunk of rows: 4 MB, about L2 x 2


@dataclass(slots=True)
class SharedPrefix:
    """Sequences whose block tables start with the same blocks, all visible to every
    query row of theirs: attention over those blocks runs once for the group
    ("cascade" attention) and is merged with each sequence's own rest by log-sum-exp."""

    block_ids: torch.Tensor  # [num_blocks] int64, the shared leading blocks
    token_rows: torch.Tensor  # [tokens] int64, this step's query rows of the group


@dataclass(slots=True)
class CPUPagedMetadata:
    """Per-step split of the batch, shared by every layer."""

    fresh: list[tuple[int, int]]  # (first token row, length) of prefills starting at 0
    kernel_rows: int  # sequences handled by the kernel
    block_tables: torch.Tensor  # [kernel_rows, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [kernel_rows] int32
    query_start: torch.Tensor  # [kernel_rows] int32: first token row of each sequence
    query_lens: torch.Tensor  # [kernel_rows] int32
    first_block: torch.Tensor | None  # [kernel_rows] int32: blocks a SharedPrefix covers
    shared: list[SharedPrefix]


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
        block_tables = batch.block_tables.index_select(0, select).contiguous()
        first_block, shared = self._find_shared_prefixes(block_tables, starts, lens, seqs, batch.block_size)
        return CPUPagedMetadata(
            fresh=fresh, kernel_rows=len(rows), block_tables=block_tables,
            seq_lens=torch.tensor(seqs, dtype=torch.int32),
            query_start=torch.tensor(starts, dtype=torch.int32),
            query_lens=torch.tensor(lens, dtype=torch.int32),
            first_block=first_block, shared=shared,
        )

    @staticmethod
    def _find_shared_prefixes(block_tables: torch.Tensor, starts: list[int], lens: list[int],
                              seqs: list[int], block_size: int) -> tuple[torch.Tensor | None, list[SharedPrefix]]:
        """Group kernel rows by their first block; a group of MIN_SHARED_SEQS or more
        whose tables agree on MIN_SHARED_BLOCKS or more leading blocks, each fully
        before all of that sequence's query rows, becomes a SharedPrefix."""
        # Blocks every query row of a sequence sees in full: those before its first row.
        visible = [(seq_len - query_len) // block_size for seq_len, query_len in zip(seqs, lens, strict=True)]
        groups: dict[int, list[int]] = {}
        for row, blocks in enumerate(visible):
            # Decode rows only: for multi-row chunks the kernel (bf16 dot products) beat
            # the float32 GEMMs (73.7 vs 103 ms a layer, 100 x 32 rows on a 1000-token prefix).
            if blocks >= MIN_SHARED_BLOCKS and lens[row] == 1:
                groups.setdefault(int(block_tables[row, 0]), []).append(row)
        first_block = [0] * len(seqs)
        shared = []
        for members in groups.values():
            if len(members) < MIN_SHARED_SEQS:
                continue
            limit = min(visible[row] for row in members)
            tables = block_tables[members, :limit]
            agree = (tables == tables[0]).all(dim=0).tolist() + [False]
            common = agree.index(False)  # leading blocks identical in every member
            if common < MIN_SHARED_BLOCKS:
                continue
            token_rows = [t for row in members for t in range(starts[row], starts[row] + lens[row])]
            shared.append(SharedPrefix(tables[0, :common].to(torch.int64),
                                       torch.tensor(token_rows, dtype=torch.int64)))
            for row in members:
                first_block[row] = common
        if not shared:
            return None, []
        return torch.tensor(first_block, dtype=torch.int32), shared

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, batch: ForwardBatch, metadata: object) -> torch.Tensor:
        assert isinstance(metadata, CPUPagedMetadata)
        write_kv(kv_cache, k, v, batch.slot_mapping)
        q = q.contiguous()
        out = torch.empty_like(q)
        if metadata.kernel_rows:
            kernel = self._kernels[q.dtype]
            first_block = metadata.first_block
            lse = None if first_block is None else torch.empty(q.shape[:2], dtype=torch.float32)
            kernel(q.data_ptr(), out.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                   metadata.block_tables.data_ptr(), metadata.block_tables.shape[1],
                   metadata.seq_lens.data_ptr(), metadata.query_start.data_ptr(),
                   metadata.query_lens.data_ptr(), 0 if first_block is None else first_block.data_ptr(),
                   0 if lse is None else lse.data_ptr(), metadata.kernel_rows, self.num_heads,
                   self.num_kv_heads, self.head_dim, batch.block_size, self.scale,
                   torch.get_num_threads())
            for prefix in metadata.shared:
                self._attend_shared_prefix(q, out, lse, kv_cache, prefix)
        for start, length in metadata.fresh:
            # [1, heads, length, head_dim] views of this step's own q/k/v.
            q_i = q[start:start + length].transpose(0, 1).unsqueeze(0)
            k_i = k[start:start + length].transpose(0, 1).unsqueeze(0)
            v_i = v[start:start + length].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q_i, k_i, v_i, is_causal=True, scale=self.scale,
                                               enable_gqa=self.num_heads != self.num_kv_heads)
            out[start:start + length] = o.squeeze(0).transpose(0, 1)
        return out

    def _attend_shared_prefix(self, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                              kv_cache: torch.Tensor, prefix: SharedPrefix) -> None:
        """Attention of the group's rows over the shared blocks as batched GEMMs (the
        prefix is read once for the group, not once per sequence), merged into ``out``,
        whose rows the kernel computed over the rest, by log-sum-exp weights.

        Both GEMMs run in float32: a bf16 score would be off by up to 2^-9 of its size,
        enough to move a softmax weight by percents (and a bf16 weighted sum of V
        measured slower here, the casts costing more than the GEMM saves). Rows go in
        chunks so the score matrix stays cache-sized.
        """
        group = self.num_heads // self.num_kv_heads
        # [kv_heads, prefix_len, head_dim]: the shared K (float32) and V (cache dtype)
        keys = kv_cache[0].index_select(0, prefix.block_ids).flatten(0, 1).transpose(0, 1).float()
        values = kv_cache[1].index_select(0, prefix.block_ids).flatten(0, 1).transpose(0, 1).float()
        keys_t = keys.transpose(1, 2).contiguous()  # [kv_heads, head_dim, prefix_len]
        chunk = max(1, SHARED_SCORE_ELEMENTS // (self.num_heads * keys.shape[1]))
        for first in range(0, prefix.token_rows.numel(), chunk):
            rows = prefix.token_rows[first:first + chunk]
            tokens = rows.numel()
            # [kv_heads, tokens * group, head_dim]: a kv head's query heads, row-major
            queries = (q.index_select(0, rows).float() * self.scale
                       ).view(tokens, self.num_kv_heads, group, self.head_dim).transpose(0, 1).flatten(1, 2)
            scores = torch.bmm(queries, keys_t)  # [kv_heads, tokens * group, prefix_len]
            row_max = scores.amax(dim=-1, keepdim=True)
            weights = torch.exp_(scores.sub_(row_max))
            row_sum = weights.sum(dim=-1, keepdim=True)
            shared_out = torch.bmm(weights, values).div_(row_sum)
            shared_lse = (row_max + row_sum.log()).squeeze(-1)  # [kv_heads, tokens * group]
            # back to [tokens, heads, ...]: head h = kv_head * group + g
            shared_out = shared_out.view(self.num_kv_heads, tokens, group, self.head_dim).transpose(0, 1)
            shared_out = shared_out.reshape(tokens, self.num_heads, self.head_dim)
            shared_lse = shared_lse.view(self.num_kv_heads, tokens, group).transpose(0, 1).reshape(tokens, -1)
            rest_lse = lse.index_select(0, rows)
            total = torch.logaddexp(shared_lse, rest_lse)
            merged = (shared_out * (shared_lse - total).exp_().unsqueeze(-1)
                      + out.index_select(0, rows).float() * (rest_lse - total).exp_().unsqueeze(-1))
            out.index_copy_(0, rows, merged.to(out.dtype))
