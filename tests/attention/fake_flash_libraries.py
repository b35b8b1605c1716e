"""Stand-ins for FlashInfer and FlashAttention 2 on CPU: each implements the documented
contract of the one call kvloom makes (argument kinds, layouts, the causal mask aligned
to the end of the keys) as a plain per-request loop, and checks its arguments the way
the library requires them. They let CI test how the ``flashinfer`` and ``flash_attn``
backends build their metadata; the libraries' own kernels run only on a GPU
(scripts/gpu_check.sh, when installed there)."""

from __future__ import annotations

import types

import torch


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, left: int = -1,
            softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of q [n, Hq, D] over keys/values [kv_len, Hkv, D], the queries
    being the last n positions (bottom-right aligned), in float32; ``left`` >= 0: each
    query sees that many keys before its own and no more (both libraries' window);
    ``softcap`` > 0: scores capped to softcap * tanh(score / softcap)."""
    n, heads, _ = q.shape
    kv_len, kv_heads, _ = keys.shape
    group = heads // kv_heads
    k = keys.float().repeat_interleave(group, dim=1)  # [kv_len, Hq, D]
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [Hq, n, kv_len]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    position = (kv_len - n + torch.arange(n))[:, None]
    allowed = torch.arange(kv_len)[None, :] <= position  # [n, kv_len]
    if left >= 0:
        allowed &= torch.arange(kv_len)[None, :] >= position - left
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(q.dtype)


class _PrefillWrapper:
    """flashinfer.BatchPrefillWithPagedKVCacheWrapper, NHD layout."""

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD") -> None:
        assert workspace.dtype == torch.uint8 and kv_layout == "NHD"
        self.plans = 0

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim, page_size, *, causal=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, q_data_type=None, kv_data_type=None) -> None:
        for host in (qo_indptr, paged_kv_indptr, paged_kv_last_page_len):  # planning reads them on the host
            assert host.device.type == "cpu" and host.dtype == torch.int32
        assert paged_kv_indices.dtype == torch.int32
        assert len(paged_kv_indices) == int(paged_kv_indptr[-1])
        assert bool(((paged_kv_last_page_len >= 1) & (paged_kv_last_page_len <= page_size)).all())
        assert causal and sm_scale is not None and q_data_type is not None and kv_data_type is not None
        self.args = (qo_indptr.tolist(), paged_kv_indptr.tolist(), paged_kv_indices, paged_kv_last_page_len.tolist(),
                     num_qo_heads, num_kv_heads, head_dim, page_size, sm_scale, window_left, logits_soft_cap or 0.0)
        self.plans += 1

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        qo, kv, pages, last, heads, kv_heads, head_dim, page_size, scale, left, cap = self.args
        k_cache, v_cache = paged_kv_cache
        assert q.shape == (qo[-1], heads, head_dim)
        assert k_cache.shape[1:] == (page_size, kv_heads, head_dim) == v_cache.shape[1:]
        out = torch.empty_like(q)
        for i in range(len(qo) - 1):
            ids = pages[kv[i]:kv[i + 1]].long()
            kv_len = (len(ids) - 1) * page_size + last[i]
            keys = k_cache[ids].reshape(-1, kv_heads, head_dim)[:kv_len]
            values = v_cache[ids].reshape(-1, kv_heads, head_dim)[:kv_len]
            out[qo[i]:qo[i + 1]] = _attend(q[qo[i]:qo[i + 1]], keys, values, scale, left, cap)
        return out


def _flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, block_table=None):
    """flash_attn.flash_attn_varlen_func with a paged KV cache (flash-attn >= 2.5);
    window_size (left, right): keys before and after each query it sees (-1: all);
    softcap (flash-attn >= 2.6): 0 for none."""
    assert causal and softmax_scale is not None and block_table is not None
    assert window_size[1] in (0, -1), "causal: no key after the query"
    assert block_table.dtype == cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    _, block_size, kv_heads, head_dim = k.shape
    assert block_size % 256 == 0, "paged KV block size must be divisible by 256"
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        kv_len = cu_k[i + 1] - cu_k[i]
        assert cu_q[i + 1] - cu_q[i] <= max_seqlen_q and kv_len <= max_seqlen_k
        ids = block_table[i, : -(-kv_len // block_size)].long()
        keys = k[ids].reshape(-1, kv_heads, head_dim)[:kv_len]
        values = v[ids].reshape(-1, kv_heads, head_dim)[:kv_len]
        out[cu_q[i]:cu_q[i + 1]] = _attend(q[cu_q[i]:cu_q[i + 1]], keys, values, softmax_scale, window_size[0],
                                           softcap)
    return out


def fake_flashinfer() -> types.ModuleType:
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = _PrefillWrapper  # type: ignore[attr-defined]
    return module


def fake_flash_attn() -> types.ModuleType:
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = _flash_attn_varlen_func  # type: ignore[attr-defined]
    return module
