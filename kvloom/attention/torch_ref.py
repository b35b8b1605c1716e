"""Pure-PyTorch paged attention: the oracle every faster backend is tested against.

For each request it gathers the request's K/V from its blocks and runs causal SDPA.
Runs on any device torch supports; clarity over speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvloom.attention.base import AttentionBackend
from kvloom.batch import ForwardBatch


class TorchReferenceBackend(AttentionBackend[None]):
    name = "torch_ref"
    supports_sinks = True

    def prepare(self, batch: ForwardBatch) -> None:
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, batch: ForwardBatch, metadata: None, window: int = 0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        self.write_kv(kv_cache, k, v, batch.slot_mapping)
        block_size = batch.block_size
        out = torch.empty_like(q)
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(batch.query_lens_list, batch.seq_lens_list, strict=True)):
            num_blocks = -(-seq_len // block_size)
            # Under a window the keys start at the first query's window: the blocks before
            # it may have been let go (their table entries then name block 0).
            first_block = max(0, seq_len - query_len + 1 - window) // block_size if window > 0 else 0
            first_key = first_block * block_size
            blocks = batch.block_tables[i, first_block:num_blocks].long()
            # [2, num_blocks, block_size, kv_heads, head_dim] -> [2, keys, kv_heads, head_dim]
            kv = kv_cache[:, blocks].flatten(1, 2)[:, :seq_len - first_key]
            # SDPA wants [batch, heads, length, head_dim].
            q_i = q[start:start + query_len].transpose(0, 1).unsqueeze(0)
            k_i = kv[0].transpose(0, 1).unsqueeze(0).to(q.dtype)
            v_i = kv[1].transpose(0, 1).unsqueeze(0).to(q.dtype)
            # Query j sits at absolute position seq_len - query_len + j and sees keys <= it,
            # under a window only the last `window` of them.
            mask = None
            if query_len > 1 or 0 < window < seq_len - first_key:
                key_pos = torch.arange(first_key, seq_len, device=q.device).unsqueeze(0)
                query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device).unsqueeze(1)
                mask = key_pos <= query_pos  # [query_len, seq_len]
                if window > 0:
                    mask &= key_pos > query_pos - window
            if self.softcap or sinks is not None:
                o = explicit_attention(q_i, k_i, v_i, mask, self.scale, self.softcap, sinks)
            else:
                o = F.scaled_dot_product_attention(
                    q_i, k_i, v_i, attn_mask=mask, scale=self.scale,
                    enable_gqa=self.num_heads != self.num_kv_heads,
                )
            out[start:start + query_len] = o.squeeze(0).transpose(0, 1)
            start += query_len
        return out


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with its scores written out, as transformers' eager attention computes
    them: Gemma 2's logit softcapping (softcap > 0: scores = softcap * tanh(q k^T * scale /
    softcap)), masked, and GPT-OSS's sinks (``sinks`` [heads]: a column of one logit per
    head joins each row's softmax and is dropped after it), the softmax in float32.
    q: [1, heads, n, d]; k, v: [1, kv_heads, m, d]; mask: [n, m] or None."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.float()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1).to(q.dtype) @ v
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return weights.to(q.dtype) @ v
