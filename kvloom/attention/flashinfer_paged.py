"""FlashInfer as the CUDA attention backend (``--attention-backend flashinfer``), when the
``flashinfer`` package is installed (``pip install flashinfer-python``).

FlashInfer reads the pool as it is: its "NHD" paged layout, [pages, page_size,
kv_heads, head_dim] for K and for V, is the token-major block every backend shares,
so the KV write stays ours (``write_token_major``). One
``BatchPrefillWithPagedKVCacheWrapper`` serves the whole mixed step (a decode is a
query of length 1; its causal mask is aligned to the end of the keys, as ours).

``prepare`` builds the step's plan once for every layer from the host-side lengths,
as FlashInfer wants them: its ``plan`` reads the indptr arrays on the host (from
device tensors it would synchronise; checked against flashinfer-python 0.7.4). A
request's pages are the first ceil(seq_len / block_size) entries of its block table,
gathered on the device; its last page holds ``seq_len - (pages - 1) * block_size``
tokens. The first layer plans the wrapper (it knows the dtypes), the rest reuse it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvloom.attention.base import AttentionBackend, import_library
from kvloom.batch import ForwardBatch

WORKSPACE_BYTES = 128 << 20  # FlashInfer's scratch for split-K partial results (its examples' size)


@dataclass(slots=True)
class FlashInferPlan:
    """The step's page table in FlashInfer's CSR form; planned into the wrapper by the
    first layer (which knows the dtypes), shared by the rest."""

    qo_indptr: torch.Tensor  # [num_seqs + 1] int32, host
    kv_indptr: torch.Tensor  # [num_seqs + 1] int32, host: prefix sums of each request's pages
    page_ids: torch.Tensor  # [total pages] int32, device
    last_page_len: torch.Tensor  # [num_seqs] int32, host: tokens in each request's last page
    block_size: int
    planned: set[int] = field(default_factory=set)  # the windows whose wrapper holds this step's plan


class FlashInferBackend(AttentionBackend[FlashInferPlan]):
    name = "flashinfer"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.library = import_library("flashinfer", "pip install flashinfer-python", self.name)
        # One wrapper per sliding window the layers use (0: none), each planned once a step
        # by the first layer with that window; made on the first step's device.
        self._wrappers: dict[int, Any] = {}

    def prepare(self, batch: ForwardBatch) -> FlashInferPlan:
        device = batch.block_tables.device
        block_size, max_blocks = batch.block_size, batch.block_tables.shape[1]
        pages = [-(-seq_len // block_size) for seq_len in batch.seq_lens_list]
        qo_indptr, kv_indptr = [0], [0]
        for query_len, num_pages in zip(batch.query_lens_list, pages, strict=True):
            qo_indptr.append(qo_indptr[-1] + query_len)
            kv_indptr.append(kv_indptr[-1] + num_pages)
        last_page_len = [seq_len - (num_pages - 1) * block_size
                         for seq_len, num_pages in zip(batch.seq_lens_list, pages, strict=True)]
        # Each request's used pages: entries [0, pages) of its row of the padded table.
        entries = [row * max_blocks + j for row, num_pages in enumerate(pages) for j in range(num_pages)]
        pinned = device.type == "cuda"  # the plan copies the host arrays to the device asynchronously
        index = torch.tensor(entries, dtype=torch.int64, pin_memory=pinned)
        page_ids = batch.block_tables.flatten()[index.to(device, non_blocking=True)]
        return FlashInferPlan(torch.tensor(qo_indptr, dtype=torch.int32, pin_memory=pinned),
                              torch.tensor(kv_indptr, dtype=torch.int32, pin_memory=pinned), page_ids,
                              torch.tensor(last_page_len, dtype=torch.int32, pin_memory=pinned), block_size)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                kv_cache: torch.Tensor, batch: ForwardBatch, metadata: FlashInferPlan,
                window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        assert v is not None and sinks is None  # no sinks here (supports_sinks)
        self.write_kv(kv_cache, k, v, batch.slot_mapping)
        wrapper = self._wrappers.get(window)
        if wrapper is None:
            workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
            wrapper = self._wrappers[window] = self.library.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        if window not in metadata.planned:
            # window_left: keys back from the query, its own not counted (-1: all).
            wrapper.plan(metadata.qo_indptr, metadata.kv_indptr, metadata.page_ids, metadata.last_page_len,
                         self.num_heads, self.num_kv_heads, self.head_dim, metadata.block_size, causal=True,
                         sm_scale=self.scale, window_left=window - 1 if window > 0 else -1,
                         logits_soft_cap=self.softcap or None, q_data_type=q.dtype, kv_data_type=kv_cache.dtype)
            metadata.planned.add(window)
        out: torch.Tensor = wrapper.run(q.contiguous(), (kv_cache[0], kv_cache[1]))
        return out
