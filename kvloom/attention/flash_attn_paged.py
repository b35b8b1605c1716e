"""FlashAttention 2 as the CUDA attention backend (``--attention-backend flash_attn``),
when the ``flash_attn`` package is installed.

``flash_attn_varlen_func`` with a ``block_table`` reads K and V from the pool as it is:
[blocks, block_size, kv_heads, head_dim] each, the token-major block every backend
shares, so the KV write stays ours. One call serves the mixed step; its causal mask is
aligned to the end of each request's keys, as ours. FlashAttention 2 pages KV only
in blocks of a multiple of 256 tokens: other block sizes are refused with the reason
(the ``triton`` and ``flashinfer`` backends take any).

``prepare`` builds the key lengths' prefix sums on the host (the batch carries the
lengths there) and copies them once; the query offsets and the block table are the
batch's own tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvloom.attention.base import AttentionBackend, import_library
from kvloom.batch import ForwardBatch

PAGE_MULTIPLE = 256  # flash-attn 2's paged KV: block sizes it accepts are multiples of this


@dataclass(frozen=True, slots=True)
class FlashAttnMetadata:
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1] int32: prefix sums of the requests' key lengths
    max_seqlen_q: int
    max_seqlen_k: int


class FlashAttnBackend(AttentionBackend[FlashAttnMetadata]):
    name = "flash_attn"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.library: Any = import_library("flash_attn", "pip install flash-attn", self.name)

    def prepare(self, batch: ForwardBatch) -> FlashAttnMetadata:
        if batch.block_size % PAGE_MULTIPLE:
            raise ValueError(f"attention_backend 'flash_attn' reads paged KV in blocks of a multiple of "
                             f"{PAGE_MULTIPLE} tokens (FlashAttention 2's rule), got block_size "
                             f"{batch.block_size}: use --block-size 256, or the triton or flashinfer backend")
        device = batch.seq_lens.device
        cumulative = [0]
        for seq_len in batch.seq_lens_list:
            cumulative.append(cumulative[-1] + seq_len)
        host = torch.tensor(cumulative, dtype=torch.int32, pin_memory=device.type == "cuda")
        return FlashAttnMetadata(host.to(device, non_blocking=True), max(batch.query_lens_list),
                                 max(batch.seq_lens_list))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                kv_cache: torch.Tensor, batch: ForwardBatch, metadata: FlashAttnMetadata,
                window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        assert v is not None and sinks is None  # no sinks here (supports_sinks)
        self.write_kv(kv_cache, k, v, batch.slot_mapping)
        out: torch.Tensor = self.library.flash_attn_varlen_func(
            q.contiguous(), kv_cache[0], kv_cache[1], batch.query_start_loc, metadata.cu_seqlens_k,
            metadata.max_seqlen_q, metadata.max_seqlen_k, softmax_scale=self.scale, causal=True,
            window_size=(window - 1, 0) if window > 0 else (-1, -1),  # keys back from the query, its own not counted
            softcap=self.softcap,  # Gemma 2's (0: none)
            block_table=batch.block_tables)
        return out
