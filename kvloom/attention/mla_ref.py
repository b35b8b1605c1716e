"""Pure-PyTorch paged attention over a latent pool (DeepSeek's multi-head latent
attention, absorbed form): the oracle for any faster MLA backend.

Each token's cache entry is one vector, ``latent = [c_kv (kv_lora_rank) | k_pe
(qk_rope_head_dim)]``, shared by every head. The model maps each head's query into
latent space beforehand through its key up-projection (``q = [q_nope @ W_uk | q_pe]``), so a head's
score against a token is ``q . latent``, and its output, in latent space, is the
softmax-weighted sum of the tokens' ``c_kv``: attention with one KV "head" whose
value is the first ``value_dim`` numbers of its key. The model then applies each
head's value up-projection. The latent is never expanded per head, in decode or
prefill (expanding would trade the per-head K/V tensors for cheaper prefill dot
products; not done).

The pool: [layers, 1, num_blocks, block_size, 1, latent_dim]; one layer's is
[1, num_blocks, block_size, 1, latent_dim], token-major.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvloom.attention.base import AttentionBackend
from kvloom.batch import ForwardBatch


class MLAReferenceBackend(AttentionBackend[None]):
    name = "mla_ref"

    def __init__(self, num_heads: int, latent_dim: int, value_dim: int, scale: float) -> None:
        super().__init__(num_heads, 1, latent_dim)
        self.value_dim = value_dim
        self.scale = scale  # the model's (qk_head_dim ** -0.5, YaRN-adjusted), not latent_dim's

    def prepare(self, batch: ForwardBatch) -> None:
        return None

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                 slot_mapping: torch.Tensor) -> None:
        """Store the step's latents ``k`` ([tokens, 1, latent_dim]); there is no V."""
        _, num_blocks, block_size, _, dim = kv_cache.shape
        kv_cache.view(num_blocks * block_size, dim).index_copy_(0, slot_mapping, k[:, 0].to(kv_cache.dtype))

    def read_kv(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, num_blocks, block_size, _, dim = kv_cache.shape
        latent = kv_cache.view(num_blocks * block_size, 1, dim)[slot_mapping]
        return latent, latent[..., :self.value_dim]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                kv_cache: torch.Tensor, batch: ForwardBatch, metadata: None, window: int = 0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [tokens, heads, latent_dim] (absorbed); k: the step's latents [tokens, 1,
        latent_dim]; v: unused. Returns [tokens, heads, value_dim], in latent space."""
        no_window(window)
        self.write_kv(kv_cache, k, None, batch.slot_mapping)
        block_size = batch.block_size
        out = q.new_empty(q.shape[0], self.num_heads, self.value_dim)
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(batch.query_lens_list, batch.seq_lens_list, strict=True)):
            blocks = batch.block_tables[i, :-(-seq_len // block_size)].long()
            latent = kv_cache[0, blocks].flatten(0, 1)[:seq_len, 0].to(q.dtype)  # [seq_len, latent_dim]
            # Query j sits at position seq_len - query_len + j and sees keys <= it.
            key_pos = torch.arange(seq_len, device=q.device)
            query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
            visible = (key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)).unsqueeze(1)  # [query_len, 1, seq_len]
            out[start:start + query_len] = self.attend(q[start:start + query_len], latent, visible)
            start += query_len
        return out

    def attend(self, q: torch.Tensor, latent: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Every head of q [..., heads, latent_dim] over one latent sequence [..., seq,
        latent_dim] (broadcast over the leading dims), where ``visible`` [..., 1 or heads,
        seq] allows: one matmul for all heads' scores (the key is shared: nothing is
        expanded per head), softmax in float32, as transformers' eager attention."""
        scores = torch.matmul(q, latent.transpose(-1, -2)) * self.scale  # [..., heads, seq]
        scores = scores.masked_fill(~visible, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, latent[..., :self.value_dim])  # [..., heads, value_dim]


@dataclass(frozen=True)
class DecodeStep:
    """What every layer of a decode-only step shares: the requests' block tables cut
    to the longest one's blocks, and which of its positions each request has."""

    blocks: torch.Tensor  # [requests, blocks] int64
    visible: torch.Tensor  # [requests, 1, longest] bool
    longest: int


class MLABatchedBackend(AttentionBackend[DecodeStep | None]):
    """The reference, with a step of decodes only (one query per request) done as one
    batched attention over every request's latents gathered into a padded
    [requests, longest, latent_dim] tensor (past a request's length, masked). Steps
    with a prefill chunk run the reference's per-request loop."""

    name = "mla_batched"

    def __init__(self, num_heads: int, latent_dim: int, value_dim: int, scale: float) -> None:
        super().__init__(num_heads, 1, latent_dim)
        self.reference = MLAReferenceBackend(num_heads, latent_dim, value_dim, scale)
        self.scale = scale

    def prepare(self, batch: ForwardBatch) -> DecodeStep | None:
        """Once per step (not per layer): None when a request brings more than one token."""
        if any(n != 1 for n in batch.query_lens_list):
            return None
        longest = max(batch.seq_lens_list)
        blocks = batch.block_tables[:, :-(-longest // batch.block_size)].long()
        seq_lens = batch.seq_lens.to(blocks.device)
        visible = torch.arange(longest, device=blocks.device) < seq_lens.unsqueeze(1)
        return DecodeStep(blocks, visible.unsqueeze(1), longest)

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                 slot_mapping: torch.Tensor) -> None:
        self.reference.write_kv(kv_cache, k, v, slot_mapping)

    def read_kv(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.reference.read_kv(kv_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                kv_cache: torch.Tensor, batch: ForwardBatch, metadata: DecodeStep | None,
                window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        no_window(window)
        if metadata is None:
            return self.reference.forward(q, k, v, kv_cache, batch, None)
        self.write_kv(kv_cache, k, None, batch.slot_mapping)
        # [requests, longest, latent]: this layer's latents of every request, padded
        latent = kv_cache[0][metadata.blocks].flatten(1, 2)[:, :metadata.longest, 0].to(q.dtype)
        return self.reference.attend(q, latent, metadata.visible)  # [requests, heads, value_dim]


def no_window(window: int) -> None:
    if window:
        raise ValueError(f"latent attention attends to whole contexts: no sliding window ({window} asked)")
