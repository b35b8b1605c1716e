"""Decode steps replayed from graphs captured at start-up, one per batch-size bucket.

A decode step's forward is hundreds of small kernel launches whose CPU cost exceeds
their GPU time at small batches; a CUDA graph replays them all in one launch. A
graph fixes every tensor's address and shape, so each bucket (1, 2, 4, ... up to
``max_batch``) owns **static buffers** (input ids, positions, slots, block tables,
context lengths) and its attention metadata (``AttentionBackend.prepare_static``: the
tile table of one query per request, and a split-K shape fixed for the longest
context, whose unused ranges are empty), all captured once. A step of ``b`` decodes
takes the smallest bucket ``B >= b``: its first ``b`` rows are copied in, the other
``B - b`` are padding that attends to one token of a **scratch block** the pool never
hands out (``scratch_block``) and writes its K/V there, so padding can never touch a
request's cache. Only the forward is captured; logits and sampling run after it,
from the bucket's first ``b`` output rows, before the next replay overwrites them.

Which steps: decode only (every entry one token, no drafts), and only models whose
forward makes no host sync and no host-side branch on the batch's values (the Llama
family; MoE routing syncs once per layer). ``Capture`` is the seam: ``CUDACapture``
records real graphs; ``EagerCapture`` runs the same function on the same static
buffers without recording, which is how the buffer and padding logic is tested on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvloom.attention.base import AttentionBackend
from kvloom.batch import ForwardBatch
from kvloom.models.registry import CausalLM

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GRAPH_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"})


class Capture(Protocol):
    def __call__(self, forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """A replay of ``forward``: same inputs (its static buffers), same output tensor."""


class EagerCapture:
    """Runs ``forward`` again at each replay: the static-buffer path without a graph."""

    def __call__(self, forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return forward


class CUDACapture:
    """Records ``forward`` into a CUDA graph (after warm-up runs on a side stream, as
    torch.cuda.graphs requires), all buckets sharing one memory pool."""

    def __init__(self) -> None:
        self.pool: Any = None

    def __call__(self, forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # Triton compiles and autotunes outside the capture
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay


@dataclass
class _Bucket:
    batch: ForwardBatch  # views of the static buffers, ``size`` rows
    replay: Callable[[], torch.Tensor]


def graph_refusal(architecture: str, is_cuda: bool, backend: AttentionBackend[Any], tensor_parallel: int,
                  enforce_eager: bool) -> str | None:
    """Why decode steps run eagerly here, or None if they can be captured."""
    if enforce_eager:
        return "enforce_eager"
    if not is_cuda:
        return "not on CUDA"
    if architecture not in GRAPH_ARCHITECTURES:
        return f"{architecture}'s forward is not captured (it syncs with the host or branches on the batch)"
    if not hasattr(backend, "prepare_static"):
        return f"attention backend {backend.name!r} has no static metadata"
    if tensor_parallel > 1:
        return "tensor parallel (collectives outside the graph)"
    return None


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv_caches: torch.Tensor, backend: AttentionBackend[Any], block_size: int,
                 max_batch: int, max_blocks: int, scratch_block: int, device: torch.device,
                 capture: Capture) -> None:
        self.max_batch = max_batch
        self.sizes = sorted({b for b in BUCKETS if b < max_batch} | {max_batch})
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), self.scratch_slot, dtype=torch.int64, device=device)
        self.block_tables = torch.full((largest, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.buckets: dict[int, _Bucket] = {}
        for size in reversed(self.sizes):  # the largest first: later graphs reuse its memory
            batch = ForwardBatch(
                input_ids=self.input_ids[:size], positions=self.positions[:size],
                slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
                seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[:size + 1],
                logits_indices=torch.arange(size, device=device), query_lens_list=[1] * size,
                seq_lens_list=[1] * size, block_size=block_size)
            metadata = backend.prepare_static(batch, max_blocks)  # type: ignore[attr-defined]

            def forward(batch: ForwardBatch = batch, metadata: Any = metadata) -> torch.Tensor:
                hidden: torch.Tensor = model(batch, kv_caches, backend, metadata)
                return hidden

            self.buckets[size] = _Bucket(batch, capture(forward))

    def serves(self, batch: ForwardBatch, has_drafts: bool) -> bool:
        """Whether this step is a decode of at most ``max_batch`` requests without drafts."""
        return (not has_drafts and 0 < batch.num_seqs <= self.max_batch
                and batch.num_tokens == batch.num_seqs and batch.state_slots is None
                and batch.output_rows is None)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The forward's hidden states [b, hidden] for ``batch`` (b decodes), replayed in
        the smallest bucket that holds it. Valid until the next ``run``."""
        count = batch.num_seqs
        size = next(s for s in self.sizes if s >= count)
        width = batch.block_tables.shape[1]
        self.input_ids[:count].copy_(batch.input_ids)
        self.positions[:count].copy_(batch.positions)
        self.slot_mapping[:count].copy_(batch.slot_mapping)
        # Columns past a request's table keep stale ids: the kernels stop at its length.
        self.block_tables[:count, :width].copy_(batch.block_tables)
        self.seq_lens[:count].copy_(batch.seq_lens)
        # The padding rows of this bucket: one token at the scratch block's first slot.
        self.input_ids[count:size].zero_()
        self.positions[count:size].zero_()
        self.slot_mapping[count:size].fill_(self.scratch_slot)
        self.block_tables[count:size, 0].fill_(self.scratch_block)
        self.seq_lens[count:size].fill_(1)
        return self.buckets[size].replay()[:count]
