"""Paged attention and the KV write in Triton: the CUDA backend's kernels
(attention/triton_paged.py), held to ``torch_ref`` by tests/kernels/test_triton_attention.py
under Triton's interpreter on CPU (``TRITON_INTERPRET=1``) and natively on a GPU.

The pool is token-major, as every backend's default: ``kv_cache[0]`` (K) and ``[1]``
(V) are [num_blocks, block_size, kv_heads, head_dim], a request's tokens in the
blocks its block table names.

One kernel serves prefill chunks, continuations after a cached prefix and decodes
(flash-attention's online softmax over the request's KV, one pool block per
iteration). A program takes one **tile**: up to ``BLOCK_Q`` consecutive queries of one
request and, for one KV head, all the query heads that share it (GQA), so each K/V
block it loads serves ``BLOCK_Q x group`` query rows (``BLOCK_M`` = their padded
count, the rows of the tile's matmuls). The tiles are listed on the host from the
step's query lengths (``tile_table``: no device sync) and copied once per step.

**Split-K.** A decode step has one query per request, so a program per (request, KV
head) would leave most of a GPU idle on long contexts. Then each tile's keys are cut
into ``num_splits`` ranges of whole blocks, each program writes its range's
unnormalised output with its running max and sum, and ``_merge_splits`` combines them
(the log-sum-exp rule); an empty range (a short request) carries weight 0.

**Sinks** (GPT-OSS's): one logit per query head that joins each query's softmax
denominator with no value, exp(sink - m) added to the row sum where m is the running max
the sum is kept under: at the end of the walk, or, under split-K, once in the merge
(against the splits' common max), never per split.

Precision: scores and the running softmax are float32; a float32 pool's tiles are
multiplied in IEEE float32 (not TF32), so the kernel matches ``torch_ref`` to 1e-5.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

NO_WINDOW = 1 << 30  # the window passed for none: longer than any context


@triton.jit
def _write_kv_kernel(k, v, k_cache, v_cache, slot_mapping, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch, block_size, head_dim,
                     HEAD_DIM_PAD: tl.constexpr):
    """Program (token, kv head): its K and V row into the slot ``slot_mapping`` names."""
    token, head = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    block, offset = slot // block_size, slot % block_size
    d = tl.arange(0, HEAD_DIM_PAD)
    mask = d < head_dim
    dst = block * stride_cb + offset * stride_cs + head * stride_ch + d
    tl.store(k_cache + dst, tl.load(k + token * stride_kt + head * stride_kh + d, mask=mask), mask=mask)
    tl.store(v_cache + dst, tl.load(v + token * stride_vt + head * stride_vh + d, mask=mask), mask=mask)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v [tokens, kv_heads, head_dim] at their slots of the token-major pool."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    _write_kv_kernel[(tokens, kv_heads)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1], head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim))


@triton.jit
def _attention_kernel(q, k_cache, v_cache, out, part_acc, part_max, part_sum, sinks,
                      tile_seq, tile_first, query_start_loc, seq_lens, block_tables,
                      scale, window, softcap, head_dim, block_size, blocks_per_split,
                      stride_qt, stride_qh, stride_ot, stride_oh,
                      stride_cb, stride_cs, stride_ch, stride_bt,
                      stride_pt, stride_ph, stride_ps,
                      GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                      KV_BLOCK: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLIT: tl.constexpr,
                      FP32_DOT: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Program (tile, KV head, split): the tile's rows attend over the split's blocks.
    Row r is query ``first + r // GROUP`` of the tile's request, query head
    ``kv_head * GROUP + r % GROUP``; it sees keys up to its own position, the last
    ``window`` of them (the host passes a window past any context for none)."""
    tile, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq = tl.load(tile_seq + tile)
    first = tl.load(tile_first + tile)  # the tile's first query, counted within its request
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    seq_len = tl.load(seq_lens + seq)
    context = seq_len - q_len  # keys before the step's queries (cached or computed earlier)

    rows = tl.arange(0, BLOCK_M)
    query = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows // GROUP < BLOCK_Q) & (query < q_len)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < head_dim
    token = (q_start + query).to(tl.int64)
    q_tile = tl.load(q + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                     mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32_DOT:
        q_tile = q_tile.to(tl.float32)

    # The tile's last query sees keys up to end (exclusive), its first from start on; this
    # split takes its share of those blocks (its blocks before start are seen by no row).
    end = context + tl.minimum(first + BLOCK_Q, q_len)
    start = tl.maximum(context + first + 1 - window, 0)
    lo = split * blocks_per_split
    hi = tl.minimum(tl.cdiv(end, KV_BLOCK), lo + blocks_per_split)
    lo = tl.maximum(lo, start // KV_BLOCK)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    offsets = tl.arange(0, KV_BLOCK)
    for index in range(lo, hi):
        physical = tl.load(block_tables + seq * stride_bt + index).to(tl.int64)
        at = physical * stride_cb + offsets[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
        k_block = tl.load(k_cache + at, mask=d_ok[None, :], other=0.0)  # [KV_BLOCK, HEAD_DIM_PAD]
        v_block = tl.load(v_cache + at, mask=d_ok[None, :], other=0.0)
        if FP32_DOT:
            k_block, v_block = k_block.to(tl.float32), v_block.to(tl.float32)
            scores = tl.dot(q_tile, tl.trans(k_block), input_precision="ieee")
        else:
            scores = tl.dot(q_tile, tl.trans(k_block))
        position = index * KV_BLOCK + offsets
        visible = ((position[None, :] <= (context + query)[:, None])
                   & (position[None, :] > (context + query - window)[:, None]) & row_ok[:, None])
        scores = scores * scale
        if softcap > 0:  # Gemma 2's: softcap * tanh(s / softcap), tanh(x) = 2 sigmoid(2x) - 1
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v_block, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v_block.dtype), v_block)
        m_i = m_new

    if SPLIT:
        at = token[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps
        tl.store(part_acc + at * HEAD_DIM_PAD + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_max + token * stride_pt + head * stride_ph + split * stride_ps, m_i, mask=row_ok)
        tl.store(part_sum + token * stride_pt + head * stride_ph + split * stride_ps, l_i, mask=row_ok)
    else:
        if HAS_SINKS:  # a row's sink joins its sum under the row's max (finite on every live row)
            sink = tl.load(sinks + head, mask=row_ok, other=float("-inf"))
            l_i += tl.exp(sink - tl.where(m_i == float("-inf"), 0.0, m_i))
        result = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 result.to(out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits(out, part_acc, part_max, part_sum, sinks, head_dim, stride_ot, stride_oh,
                  stride_pt, stride_ph, stride_ps, NUM_SPLITS: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                  HAS_SINKS: tl.constexpr):
    """Program (token, head): its splits' partial outputs combined by log-sum-exp."""
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM_PAD)
    base = token * stride_pt + head * stride_ph + splits * stride_ps
    maxima = tl.load(part_max + base)
    top = tl.max(maxima, 0)
    weight = tl.where(maxima == float("-inf"), 0.0, tl.exp(maxima - top))  # an empty split weighs 0
    total = tl.sum(tl.load(part_sum + base) * weight, 0)
    if HAS_SINKS:  # once, under the splits' common max (finite: the query's own key is in a split)
        total += tl.exp(tl.load(sinks + head) - top)
    acc = tl.load(part_acc + base[:, None] * HEAD_DIM_PAD + d[None, :])
    result = tl.sum(acc * weight[:, None], 0) / total
    tl.store(out + token * stride_ot + head * stride_oh + d, result.to(out.dtype.element_ty), mask=d < head_dim)


def interpreting() -> bool:
    """Whether the kernels run in Triton's interpreter (TRITON_INTERPRET=1, on CPU):
    its ``tl.dot`` of bfloat16 tiles is wrong (triton 3.9: numbers off by 1e10), so there
    half-precision tiles are multiplied in float32; on a GPU they go to the tensor cores
    as they are, and the CUDA run of the tests checks that path."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def tile_table(query_lens: list[int], block_q: int) -> tuple[list[int], list[int]]:
    """(request of each tile, its first query within the request): every request's
    queries cut into tiles of at most ``block_q``."""
    seqs: list[int] = []
    firsts: list[int] = []
    for seq, length in enumerate(query_lens):
        for first in range(0, length, block_q):
            seqs.append(seq)
            firsts.append(first)
    return seqs, firsts


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, tiles: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, block_q: int, num_splits: int, blocks_per_split: int, window: int = 0,
                    softcap: float = 0.0, sinks: torch.Tensor | None = None) -> None:
    """out [tokens, heads, head_dim] = causal attention of q over each request's paged
    K/V. ``tiles``: [2, num_tiles] int32 from ``tile_table``; ``num_splits`` > 1 (for
    decode steps) cuts each tile's keys into ranges of ``blocks_per_split`` blocks.
    ``window`` > 0: a sliding window, each query attending to its last ``window`` keys;
    ``softcap`` > 0: each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2's).
    ``sinks``: GPT-OSS's attention sinks, a contiguous [heads] float32 tensor on q's device
    (one logit per query head; None: none)."""
    tokens, heads, head_dim = q.shape
    if sinks is not None:
        _check_sinks(sinks, heads, q.device)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    block_m = max(16, triton.next_power_of_2(block_q * group))
    pad = triton.next_power_of_2(head_dim)
    split = num_splits > 1
    if split:
        part_acc = torch.empty(tokens, heads, num_splits, pad, dtype=torch.float32, device=q.device)
        part_max = torch.empty(tokens, heads, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused
    strides = part_max.stride() if split else (0, 0, 0)
    sink_logits = out if sinks is None else sinks  # never read without sinks (HAS_SINKS)
    _attention_kernel[(tiles.shape[1], kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_acc, part_max, part_sum, sink_logits, tiles[0], tiles[1], query_start_loc,
        seq_lens, block_tables, scale, window if window > 0 else NO_WINDOW, softcap, head_dim, block_size,
        blocks_per_split if split else block_tables.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), *strides,
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, KV_BLOCK=block_size, HEAD_DIM_PAD=pad, SPLIT=split,
        FP32_DOT=q.dtype == torch.float32 or interpreting(), HAS_SINKS=sinks is not None)
    if split:
        _merge_splits[(tokens, heads)](out, part_acc, part_max, part_sum, sink_logits, head_dim, out.stride(0),
                                      out.stride(1), *strides, NUM_SPLITS=num_splits, HEAD_DIM_PAD=pad,
                                      HAS_SINKS=sinks is not None)


def _check_sinks(sinks: torch.Tensor, heads: int, device: torch.device) -> None:
    """A ValueError naming what is wrong, unless ``sinks`` is what the kernels read."""
    if (sinks.dtype != torch.float32 or sinks.dim() != 1 or sinks.shape[0] != heads or sinks.device != device
            or not sinks.is_contiguous()):
        raise ValueError(f"triton paged_attention: sinks must be a contiguous [{heads}] float32 tensor on {device} "
                         f"(one logit per query head), got {list(sinks.shape)} {sinks.dtype} on {sinks.device}"
                         f"{'' if sinks.is_contiguous() else ', not contiguous'}")
