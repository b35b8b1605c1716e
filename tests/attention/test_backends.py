"""Every fast attention path equals the pure-PyTorch reference on mixed batches."""

from __future__ import annotations

import pytest
import torch
from helpers_attention import FEW, MIXED, UNEVEN, batches_with_blocks_let_go, mixed_batch

from kvloom.attention.registry import make_backend
from kvloom.batch import ForwardBatch

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (9, 3, 64), (8, 1, 32), (6, 2, 128), (4, 1, 256)])
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
@pytest.mark.parametrize("shapes", [MIXED, FEW, UNEVEN], ids=["mixed", "few", "uneven"])
def test_cpu_paged_matches_reference(dtype, heads, kv_heads, head_dim, block_size, shapes, paired_path) -> None:
    torch.manual_seed(0)
    num_blocks = 400
    output = mixed_batch(block_size, num_blocks, seed=block_size + heads, shapes=shapes)
    batch = ForwardBatch.build(output, block_size, torch.device("cpu"))
    tokens = batch.num_tokens
    q = torch.randn(tokens, heads, head_dim, dtype=dtype)
    k = torch.randn(tokens, kv_heads, head_dim, dtype=dtype)
    v = torch.randn(tokens, kv_heads, head_dim, dtype=dtype)
    reference = make_backend("torch_ref", torch.device("cpu"), heads, kv_heads, head_dim)
    fast = make_backend("cpu_paged", torch.device("cpu"), heads, kv_heads, head_dim)
    # The same history (every slot of the pool) written by each backend in its layout.
    all_slots = torch.arange(num_blocks * block_size)
    history_k = torch.randn(len(all_slots), kv_heads, head_dim, dtype=dtype)
    history_v = torch.randn(len(all_slots), kv_heads, head_dim, dtype=dtype)
    cache_ref = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    cache_fast = torch.zeros_like(cache_ref)
    reference.write_kv(cache_ref, history_k, history_v, all_slots)
    fast.write_kv(cache_fast, history_k, history_v, all_slots)
    expected = reference.forward(q, k, v, cache_ref, batch, reference.prepare(batch))
    actual = fast.forward(q, k, v, cache_fast, batch, fast.prepare(batch))
    for held_ref, held_fast in zip(reference.read_kv(cache_ref, all_slots), fast.read_kv(cache_fast, all_slots),
                                   strict=True):
        assert torch.equal(held_ref, held_fast)  # both wrote the same slots
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("block_size", [16, 32, 5])
def test_cpu_paged_layout_round_trip(block_size) -> None:
    """write_kv then read_kv gives back what was written, slot by slot, and bf16 caches
    of kernel-friendly shapes really use the paired layout (K's dim pairs of one key are
    block_size words apart), where the CPU has AVX-512."""
    torch.manual_seed(1)
    kv_heads, head_dim, num_blocks = 3, 64, 6
    backend = make_backend("cpu_paged", torch.device("cpu"), 9, kv_heads, head_dim)
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size)[:40]
    k = torch.randn(len(slots), kv_heads, head_dim, dtype=torch.bfloat16)
    v = torch.randn(len(slots), kv_heads, head_dim, dtype=torch.bfloat16)
    backend.write_kv(cache, k, v, slots)
    held_k, held_v = backend.read_kv(cache, slots)
    assert torch.equal(held_k, k) and torch.equal(held_v, v)
    if backend.paired_layout(cache):
        assert block_size % 16 == 0
        slot = int(slots[0])
        block, offset = divmod(slot, block_size)
        words = cache[0, block].flatten().view(torch.int32)  # this block's K, 32-bit words
        pair = torch.tensor([k[0, 0, 2], k[0, 0, 3]]).view(torch.int32)  # dims 2, 3 of head 0
        assert words[1 * block_size + offset] == pair  # (head 0, dim pair 1, this key)
    else:
        assert block_size % 16 != 0 or not torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        # (torch's AVX512 capability means AVX512F/BW/VL/DQ: what the paired kernel needs)


def naive_windowed_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: list[int],
                             scale: float, window: int, softcap: float = 0.0) -> torch.Tensor:
    """Each query (at positions[i]) over keys max(0, p - window + 1) .. p of its sequence
    (window 0: all of them), one softmax at a time in float64: the definition of a sliding
    window; ``softcap`` > 0: each scaled score s capped to softcap * tanh(s / softcap)."""
    group = q.shape[1] // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, position in enumerate(positions):
        first = max(0, position - window + 1) if window else 0
        k = keys[first:position + 1].double().repeat_interleave(group, dim=1)  # [n, heads, head_dim]
        v = values[first:position + 1].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        weights = scores.softmax(dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", weights, v)
    return out


@pytest.mark.parametrize("window,softcap", [(1, 0.0), (7, 0.0), (16, 0.0), (33, 0.0), (0, 1.5), (7, 1.5)])
def test_torch_ref_sliding_window_is_the_definition(window, softcap) -> None:
    """torch_ref's window mask (and Gemma 2's softcap) against a per-query loop over the
    window's keys: a fresh prompt, a chunk after a prefix, and a decode, in one batch."""
    torch.manual_seed(1)
    block_size, num_blocks, heads, kv_heads, head_dim = 8, 64, 4, 2, 16
    shapes = [(0, 40), (30, 12), (50, 1)]
    batch = ForwardBatch.build(mixed_batch(block_size, num_blocks, seed=3, shapes=shapes), block_size,
                               torch.device("cpu"))
    reference = make_backend("torch_ref", torch.device("cpu"), heads, kv_heads, head_dim)
    reference.softcap = softcap
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim)
    all_slots = torch.arange(num_blocks * block_size)
    history = torch.randn(2, len(all_slots), kv_heads, head_dim)
    reference.write_kv(cache, history[0], history[1], all_slots)
    q = torch.randn(batch.num_tokens, heads, head_dim)
    k = torch.randn(batch.num_tokens, kv_heads, head_dim)
    v = torch.randn(batch.num_tokens, kv_heads, head_dim)
    actual = reference.forward(q, k, v, cache, batch, None, window)
    start = 0
    for i, (done, new) in enumerate(shapes):
        slots = (batch.block_tables[i, torch.arange(done + new) // block_size].long() * block_size
                 + torch.arange(done + new) % block_size)
        keys, values = reference.read_kv(cache, slots)
        expected = naive_windowed_attention(q[start:start + new], keys, values, list(range(done, done + new)),
                                            reference.scale, window, softcap)
        torch.testing.assert_close(actual[start:start + new].double(), expected, atol=1e-5, rtol=1e-5)
        start += new


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (9, 3, 64), (6, 2, 128)])
@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("window", [1, 9, 16, 37])
def test_cpu_paged_sliding_window_matches_reference(dtype, heads, kv_heads, head_dim, block_size, window,
                                                    paired_path) -> None:
    """Every path of the kernel under a sliding window (ending mid-tile, on a tile's edge,
    one key) against torch_ref's, over decodes, prefills and chunks of every length."""
    torch.manual_seed(0)
    num_blocks = 400
    batch = ForwardBatch.build(mixed_batch(block_size, num_blocks, seed=window, shapes=MIXED + UNEVEN),
                               block_size, torch.device("cpu"))
    q = torch.randn(batch.num_tokens, heads, head_dim, dtype=dtype)
    k = torch.randn(batch.num_tokens, kv_heads, head_dim, dtype=dtype)
    v = torch.randn(batch.num_tokens, kv_heads, head_dim, dtype=dtype)
    outputs = []
    all_slots = torch.arange(num_blocks * block_size)
    history = torch.randn(2, len(all_slots), kv_heads, head_dim, dtype=dtype)
    for name in ("torch_ref", "cpu_paged"):
        backend = make_backend(name, torch.device("cpu"), heads, kv_heads, head_dim)
        cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
        backend.write_kv(cache, history[0], history[1], all_slots)
        outputs.append(backend.forward(q, k, v, cache, batch, backend.prepare(batch), window))
    expected, actual = outputs
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,window", [(5, 9), (16, 16), (16, 37)])
@pytest.mark.parametrize("name", ["torch_ref", "cpu_paged"])
def test_blocks_let_go_behind_the_window_are_never_read(name, dtype, block_size, window, paired_path) -> None:
    """The blocks the KV cache manager lets go behind a sliding window reach the kernel as
    block 0: filled with NaN here, the output keeps the bits it has with every block."""
    torch.manual_seed(0)
    num_blocks, heads, kv_heads, head_dim = 400, 9, 3, 64
    whole, let_go = batches_with_blocks_let_go(block_size, num_blocks, window, MIXED + UNEVEN, window,
                                               torch.device("cpu"))
    assert int((let_go.block_tables != whole.block_tables).sum()) > 10  # blocks were let go
    q = torch.randn(whole.num_tokens, heads, head_dim, dtype=dtype)
    k = torch.randn(whole.num_tokens, kv_heads, head_dim, dtype=dtype)
    v = torch.randn(whole.num_tokens, kv_heads, head_dim, dtype=dtype)
    history = torch.randn(2, num_blocks * block_size, kv_heads, head_dim, dtype=dtype)
    backend = make_backend(name, torch.device("cpu"), heads, kv_heads, head_dim)
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    backend.write_kv(cache, history[0], history[1], torch.arange(num_blocks * block_size))
    expected = backend.forward(q, k, v, cache.clone(), whole, backend.prepare(whole), window)
    poisoned = cache.clone()
    poisoned[:, 0] = float("nan")
    actual = backend.forward(q, k, v, poisoned, let_go, backend.prepare(let_go), window)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (9, 3, 64), (4, 2, 256)])
@pytest.mark.parametrize("window", [0, 9])
def test_cpu_paged_softcap_matches_reference(dtype, heads, kv_heads, head_dim, window, paired_path) -> None:
    """Gemma 2's logit softcapping (a cap of 1.5, where most scores bend) on every path of
    the kernel (head_dim 256: Gemma 2's, the token-major path), with and without a window."""
    torch.manual_seed(0)
    num_blocks, block_size = 200, 16
    batch = ForwardBatch.build(mixed_batch(block_size, num_blocks, seed=4, shapes=MIXED), block_size,
                               torch.device("cpu"))
    q, k, v = (torch.randn(batch.num_tokens, n, head_dim, dtype=dtype) * 2 for n in (heads, kv_heads, kv_heads))
    all_slots = torch.arange(num_blocks * block_size)
    history = torch.randn(2, len(all_slots), kv_heads, head_dim, dtype=dtype) * 2
    outputs = []
    for name in ("torch_ref", "cpu_paged"):
        backend = make_backend(name, torch.device("cpu"), heads, kv_heads, head_dim)
        backend.softcap = 1.5
        cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
        backend.write_kv(cache, history[0], history[1], all_slots)
        outputs.append(backend.forward(q, k, v, cache, batch, backend.prepare(batch), window))
    expected, actual = outputs
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
