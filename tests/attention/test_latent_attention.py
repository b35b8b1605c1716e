"""The latent attention kernel (``kvloom::latent_attention``, csrc/latent_attention.cpp)
against attention over the same latents computed in float64 by hand, and its invariant:
a query's result is the same bits alone, batched, chunked, on one thread or two. The
model-level tests (DeepSeek's greedy tokens against transformers through this backend)
are in tests/models/test_deepseek.py."""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels import latent_attention as kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="latent_attention.cpp does not build here")


def int32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


class Pool:
    """Sequences of (query_len, seq_len) over scattered blocks of one layer's latents."""

    def __init__(self, spans: list[tuple[int, int]], dim: int, dtype: torch.dtype, block_size: int = 16,
                 heads: int = 3, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        blocks = [-(-seq_len // block_size) for _, seq_len in spans]
        num_blocks = sum(blocks) + 3
        self.cache = torch.randn(1, num_blocks, block_size, 1, dim, generator=generator).to(dtype)
        order = torch.randperm(num_blocks, generator=generator).tolist()
        self.tables = torch.zeros(len(spans), max(blocks), dtype=torch.int32)
        for i, count in enumerate(blocks):
            for b in range(count):
                self.tables[i, b] = order.pop()
        self.spans, self.block_size = spans, block_size
        self.starts = [sum(q for q, _ in spans[:i]) for i in range(len(spans))]
        self.q = torch.randn(sum(q for q, _ in spans), heads, dim, generator=generator).to(dtype)

    def run(self, value_dim: int, scale: float, rows: list[int] | None = None,
            products: str = "float32") -> torch.Tensor:
        """The kernel over sequences ``rows`` (default all), their queries packed in order."""
        rows = list(range(len(self.spans))) if rows is None else rows
        q = torch.cat([self.q[self.starts[i]:self.starts[i] + self.spans[i][0]] for i in rows])
        starts = [sum(self.spans[j][0] for j in rows[:n]) for n in range(len(rows))]
        return kernels.latent_attention(q.contiguous(), self.cache, self.tables[rows].contiguous(),
                                        int32(*(self.spans[i][1] for i in rows)), int32(*starts),
                                        int32(*(self.spans[i][0] for i in rows)), value_dim, scale, products)

    def oracle(self, value_dim: int, scale: float) -> torch.Tensor:
        """Every query over the keys at or before its position, in float64."""
        out = []
        for i, (query_len, seq_len) in enumerate(self.spans):
            blocks = self.tables[i, :-(-seq_len // self.block_size)].long()
            latent = self.cache[0, blocks].flatten(0, 1)[:seq_len, 0].double()  # [seq_len, dim]
            q = self.q[self.starts[i]:self.starts[i] + query_len].double()  # [query_len, heads, dim]
            scores = torch.einsum("qhd,kd->qhk", q, latent) * scale
            visible = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - query_len, seq_len)[:, None]
            weights = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
            out.append(torch.einsum("qhk,kv->qhv", weights, latent[:, :value_dim]))
        return torch.cat(out)


# Decodes at several lengths, a chunk after a cached prefix, a fresh prompt longer than a tile.
SPANS = [(1, 37), (5, 5), (20, 60), (1, 1), (1, 16), (17, 33)]
# (cache dtype, products): every path this CPU runs (bf16 products: AVX512-BF16 only).
PATHS = [(torch.float32, "float32"), (torch.bfloat16, "float32")] + (
    [(torch.bfloat16, "bf16")] if kernels.has_bf16_products() else [])


@pytest.mark.parametrize(("dtype", "products"), PATHS)
@pytest.mark.parametrize(("dim", "value_dim", "block_size"),
                         [(288, 256, 16), (576, 512, 16), (40, 32, 8), (24, 5, 32), (72, 64, 16)])
def test_matches_float64_attention(dtype: torch.dtype, products: str, dim: int, value_dim: int,
                                   block_size: int) -> None:
    """Latent widths of DeepSeek-V2 (576 = 512 + 64), the bench's shape (288), and widths
    that are not multiples of 16 or 32 (the kernel pads them); blocks of 8 and 32 keys too."""
    pool = Pool(SPANS, dim, dtype, block_size)
    out = pool.run(value_dim, 0.1, products=products)
    assert out.shape == (pool.q.shape[0], 3, value_dim) and out.dtype == dtype
    expected = pool.oracle(value_dim, 0.1)
    if dtype == torch.float32:  # float32 sums over up to 60 keys and 576 dims
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-6)
    elif products == "float32":  # one rounding of the output to bf16 (the sums are float32)
        torch.testing.assert_close(out.double(), expected.to(dtype).double(), rtol=2 ** -7, atol=1e-3)
    else:  # the weights rounded to bf16 too (as the reference's softmax output is)
        torch.testing.assert_close(out.double(), expected, rtol=2 ** -6, atol=4e-3)


@pytest.mark.parametrize(("dtype", "products"), PATHS)
def test_a_query_gets_the_same_bits_in_any_batch_and_chunk(dtype: torch.dtype, products: str) -> None:
    """Sequence 2's 20 query rows (positions 40-59) in the whole batch, alone, as its last
    5 rows alone, as its last row alone (a decode), and on one thread: bit for bit."""
    pool = Pool(SPANS, 288, dtype, heads=9)
    whole = pool.run(256, 0.07, products=products)
    first = pool.starts[2]
    alone = pool.run(256, 0.07, rows=[2], products=products)
    assert torch.equal(whole[first:first + 20], alone)
    tail = Pool([(5, 60)], 288, dtype, heads=9)
    tail.cache, tail.tables = pool.cache, pool.tables[2:3].contiguous()
    tail.q = pool.q[first + 15:first + 20]
    assert torch.equal(tail.run(256, 0.07, products=products), whole[first + 15:first + 20])
    decode = Pool([(1, 60)], 288, dtype, heads=9)
    decode.cache, decode.tables, decode.q = pool.cache, tail.tables, pool.q[first + 19:first + 20]
    assert torch.equal(decode.run(256, 0.07, products=products), whole[first + 19:first + 20])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(pool.run(256, 0.07, products=products), whole)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("heads", "spans"), [(128, [(16, 40), (1, 70)]), (17, [(15, 40), (3, 9)]),
                                              (300, [(1, 20), (16, 16)])])
def test_many_heads_split_across_items_agree_with_the_oracle(heads: int, spans: list[tuple[int, int]]) -> None:
    """More vectors (rows x heads) than one work item holds: 128 heads (DeepSeek-V2's) over
    16 rows, 17 heads over 15 (uneven shares), 300 heads (more than an item even at one row)."""
    pool = Pool(spans, 64, torch.float32, heads=heads, seed=3)
    torch.testing.assert_close(pool.run(48, 0.2).double(), pool.oracle(48, 0.2), rtol=1e-5, atol=2e-6)


def test_bf16_products_refused_where_they_do_not_apply() -> None:
    pool = Pool([(1, 5)], 32, torch.float32)
    with pytest.raises(ValueError, match="kvloom::latent_attention: products 'bf16' needs a bf16 cache"):
        pool.run(32, 0.1, products="bf16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize(("heads", "dim"), [(9, 32), (16, 64), (1, 64), (3, 6)])
def test_rotary_is_the_pytorch_rotation_bit_for_bit(dtype: torch.dtype, interleaved: bool, heads: int,
                                                    dim: int) -> None:
    """``kvloom::latent_rotary`` against models/deepseek.py's PyTorch ops (transformers'
    DeepSeek rotation in float32): the same bits, at angles up to ~150 radians."""
    from kvloom.models.deepseek import rotate_reference
    generator = torch.Generator().manual_seed(heads * dim)
    x = (torch.randn(7, heads, dim, generator=generator) * 3).to(dtype)
    angles = torch.randn(7, dim // 2, generator=generator) * 50
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    assert torch.equal(kernels.latent_rotary(x, cos, sin, interleaved), rotate_reference(x, cos, sin, interleaved))
