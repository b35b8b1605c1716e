"""The CUDA attention backend: paged attention and the KV write as Triton kernels
(kvloom/kernels/triton_attention.py), over the token-major pool every backend
shares by default.

``prepare`` does the step's host work once, from the host-side lengths the batch
carries (no device sync): the tile table (each request's queries cut into tiles of
``block_q``, each tile with all query heads of one KV head), and for a decode-only
step the split-K shape (enough key ranges per request to fill the device on long
contexts). Every layer's ``forward`` then launches the same kernels. It also runs on
CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI holds
it to ``torch_ref``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvloom.attention.base import AttentionBackend
from kvloom.batch import ForwardBatch
from kvloom.kernels import triton_attention

ROWS_PER_TILE = 64  # a prefill tile's query rows (queries x the heads sharing a KV head)
BLOCKS_PER_SPLIT = 16  # a decode split's share of a request's blocks, whatever the batch


@dataclass(frozen=True, slots=True)
class TritonMetadata:
    tiles: torch.Tensor  # [2, num_tiles] int32: each tile's request and first query
    block_q: int  # queries per tile
    num_splits: int  # key ranges per tile (a power of two; 1: no split)
    blocks_per_split: int


def split_shape(max_blocks: int) -> tuple[int, int]:
    """(num_splits, blocks_per_split) for a decode step whose longest request holds
    ``max_blocks`` blocks: a split per ``BLOCKS_PER_SPLIT`` blocks, rounded up to a
    power of two (the merge's width). The ranges are the same whatever else is in the
    batch: a request's keys are always cut every ``BLOCKS_PER_SPLIT`` blocks, and the
    splits a longer request adds are empty for it (weight 0, sums of exact zeros), so a
    decode's attention is bit for bit the same alone, batched, or replayed from a CUDA
    graph captured for the longest context."""
    wanted = -(-max_blocks // BLOCKS_PER_SPLIT)
    num_splits = 1
    while num_splits < wanted:
        num_splits *= 2
    return num_splits, BLOCKS_PER_SPLIT


class TritonPagedBackend(AttentionBackend[TritonMetadata]):
    name = "triton"
    supports_sinks = True  # added to each row's softmax sum at the end (split-K: in the merge)

    def prepare(self, batch: ForwardBatch) -> TritonMetadata:
        group = self.num_heads // self.num_kv_heads
        decode_only = max(batch.query_lens_list, default=0) <= 1
        block_q = 1 if decode_only else max(1, ROWS_PER_TILE // group)
        seqs, firsts = triton_attention.tile_table(batch.query_lens_list, block_q)
        device = batch.seq_lens.device  # pinned on CUDA, as the batch's own fields: the copy is asynchronous
        tiles = torch.tensor([seqs, firsts], dtype=torch.int32, pin_memory=device.type == "cuda")
        tiles = tiles.to(device, non_blocking=True)
        num_splits, per_split = 1, 0
        if decode_only and batch.seq_lens_list:
            num_splits, per_split = split_shape(-(-max(batch.seq_lens_list) // batch.block_size))
        return TritonMetadata(tiles, block_q, num_splits, per_split)

    def prepare_static(self, batch: ForwardBatch, max_blocks: int) -> TritonMetadata:
        """A decode step's metadata that holds whatever its lengths, up to ``max_blocks``
        blocks a request (runner/cuda_graphs.py captures it once per bucket): one tile
        per request, the split shape of the longest context (shorter ones leave their
        later ranges empty)."""
        count = batch.num_seqs
        tiles = torch.tensor([list(range(count)), [0] * count], dtype=torch.int32, device=batch.seq_lens.device)
        num_splits, per_split = split_shape(max_blocks)
        return TritonMetadata(tiles, 1, num_splits, per_split)

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        triton_attention.write_kv(kv_cache, _unit_last(k), _unit_last(v), slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                kv_cache: torch.Tensor, batch: ForwardBatch, metadata: TritonMetadata,
                window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if v is None:
            raise ValueError("the triton backend serves K/V attention; latent attention has its own backends")
        self.write_kv(kv_cache, k, v, batch.slot_mapping)
        q = _unit_last(q)
        out = torch.empty_like(q)
        if sinks is not None:
            sinks = sinks.to(q.device, torch.float32).contiguous()  # the model's dtype; the kernels read float32
        triton_attention.paged_attention(
            q, kv_cache, out, metadata.tiles, batch.query_start_loc, batch.seq_lens, batch.block_tables,
            self.scale, metadata.block_q, metadata.num_splits, metadata.blocks_per_split, window, self.softcap,
            sinks)
        return out


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """x with unit stride in its last dimension, which the kernels index directly."""
    return x if x.stride(-1) == 1 else x.contiguous()
