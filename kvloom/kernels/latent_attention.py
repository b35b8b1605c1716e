"""Latent attention over a paged pool of latents (kvloom/csrc/latent_attention.cpp) as
``kvloom::latent_attention`` (and ``kvloom::latent_rotary``, the rotary part of its queries
and keys): DeepSeek's multi-head latent attention in its absorbed form, each token's
cache entry one ``dim``-wide vector shared by every head, its first ``value_dim``
numbers the value (attention/mla_ref.py's reference computes the same).

Every query vector (a head of a query token) is computed by the same operations in the
same order whatever else the call holds: a token's result does not depend on its batch,
nor on how its prompt was cut into chunks (the kernel's comment has the order). float32
sums; the output rounded once to q's dtype. The products (:data:`PRODUCTS`): ``float32``
(every CPU: the numbers widened, fmas) or, for bf16 caches where the CPU has AVX512-BF16,
``bf16`` (vdpbf16ps: twice the work per instruction, the weights rounded to bf16 as the
reference's softmax output is). The two agree to rounding, not bit for bit, so one is
chosen for the whole process (:func:`default_products`; ``$KVLOOM_CPU_ISA`` below
``avx512_bf16`` keeps float32).

The index arrays are the caller's contract, as for ``kvloom::paged_attention``: block ids
below num_blocks, ``seq_lens`` within each block table, ``query_start + query_lens``
within q's rows.
"""

from __future__ import annotations

import functools

import torch

from kvloom.kernels import gemm
from kvloom.kernels.native_op import NativeFunction, NativeOp, TensorSpec

ACTIVATIONS = (torch.float32, torch.bfloat16)
_INT32 = (torch.int32,)
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
PRODUCTS = ("float32", "bf16")  # the index is latent_attention.cpp's Products
_HAS_BF16 = NativeFunction("latent_attention", "kvloom_latent_attention_bf16() -> int32")

LATENT_ATTENTION = NativeOp(
    "latent_attention(Tensor q, Tensor cache, Tensor block_tables, Tensor seq_lens, Tensor query_start, "
    "Tensor query_lens, int value_dim, float scale, str products) -> Tensor",
    library="latent_attention",
    native="kvloom_latent_attention(q, Tensor out, cache, block_tables, int max_blocks, seq_lens, query_start, "
           "query_lens, int num_seqs, int num_heads, int dim, value_dim, int block_size, scale, int32 dtype, "
           "int32 products, int32 num_threads) -> int32",
    tensors={"q": TensorSpec(3, like="cache"), "cache": TensorSpec(5, ACTIVATIONS),
             "block_tables": TensorSpec(2, _INT32), "seq_lens": TensorSpec(1, _INT32),
             "query_start": TensorSpec(1, _INT32), "query_lens": TensorSpec(1, _INT32)},
)


@LATENT_ATTENTION.check
def _latent_attention_check(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, query_start: torch.Tensor, query_lens: torch.Tensor,
                            value_dim: int, scale: float, products: str) -> None:
    dim = q.shape[2]
    if cache.shape[0] != 1 or cache.shape[3] != 1 or cache.shape[4] != dim:
        raise LATENT_ATTENTION.error("cache", f"must be one layer's latents, [1, num_blocks, block_size, 1, {dim}] "
                                              f"for q's {dim}-wide vectors, got {list(cache.shape)}")
    if not 0 < value_dim <= dim:
        raise LATENT_ATTENTION.error("value_dim", f"must be positive and no wider than the latent ({dim}), "
                                                  f"got {value_dim}")
    if products not in PRODUCTS:
        raise LATENT_ATTENTION.error("products", f"must be one of {PRODUCTS}, got {products!r}")
    if products == "bf16" and (q.dtype is not torch.bfloat16 or not has_bf16_products()):
        raise LATENT_ATTENTION.error("products", f"'bf16' needs a bf16 cache and a CPU with AVX512-BF16 (this "
                                                 f"one runs {supported_products()}); the cache is {q.dtype}")
    num_seqs = block_tables.shape[0]
    for name, array in (("seq_lens", seq_lens), ("query_start", query_start), ("query_lens", query_lens)):
        if array.shape[0] != num_seqs:
            raise LATENT_ATTENTION.error(name, f"must have one entry per block table ({num_seqs}), "
                                               f"got {array.shape[0]}")


@LATENT_ATTENTION.implementation
def _latent_attention_cpu(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                          seq_lens: torch.Tensor, query_start: torch.Tensor, query_lens: torch.Tensor,
                          value_dim: int, scale: float, products: str) -> torch.Tensor:
    tokens, heads, dim = q.shape
    out = q.new_empty(tokens, heads, value_dim)
    status = LATENT_ATTENTION.function()(
        q.data_ptr(), out.data_ptr(), cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
        seq_lens.data_ptr(), query_start.data_ptr(), query_lens.data_ptr(), block_tables.shape[0], heads, dim,
        value_dim, cache.shape[2], scale, _DTYPE_CODES[q.dtype], PRODUCTS.index(products), torch.get_num_threads())
    if status != 0:  # the checks above admit only what the kernel takes
        raise RuntimeError(f"kvloom::latent_attention refused q {list(q.shape)} with value_dim {value_dim}")
    return out


@LATENT_ATTENTION.fake
def _latent_attention_fake(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, query_start: torch.Tensor, query_lens: torch.Tensor,
                           value_dim: int, scale: float, products: str) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], value_dim)


def available() -> bool:
    """Whether latent_attention.cpp builds here; where not, the PyTorch backends serve."""
    return LATENT_ATTENTION.available()


def has_bf16_products() -> bool:
    """Whether this build has the vdpbf16ps path (a CPU with AVX512-BF16)."""
    return _HAS_BF16.available() and bool(_HAS_BF16.function()())


def supported_products() -> tuple[str, ...]:
    return PRODUCTS if has_bf16_products() else PRODUCTS[:1]


@functools.cache  # one choice per process: the two paths agree to rounding, not bit for bit
def default_products() -> str:
    """The products of bf16 calls: ``bf16`` where the build has them and the GEMM's path
    (``gemm.default_isa()``, capped by ``$KVLOOM_CPU_ISA``) is avx512_bf16 or better, as
    paired-layout attention chooses; else ``float32``."""
    isa = gemm.default_isa()
    vdpbf16ps = isa is not None and gemm.ISAS.index(isa) >= gemm.ISAS.index("avx512_bf16")
    return "bf16" if has_bf16_products() and vdpbf16ps else "float32"


def latent_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     query_start: torch.Tensor, query_lens: torch.Tensor, value_dim: int,
                     scale: float, products: str | None = None) -> torch.Tensor:
    """Each query vector of q [tokens, heads, dim] (in latent space) over its sequence's
    cached latents, read through its block table ([num_seqs, max_blocks] int32) from
    ``cache``, one layer's pool [1, num_blocks, block_size, 1, dim] of q's dtype (float32
    or bf16); ``seq_lens``, ``query_start`` (first row in q) and ``query_lens``:
    [num_seqs] int32. A query at position p sees the keys at positions <= p. Returns
    [tokens, heads, value_dim]: the weighted sums of the keys' first ``value_dim``
    numbers. ``products``: :data:`PRODUCTS` (default: ``float32`` for a float32 cache,
    :func:`default_products` for bf16). Wrong arguments raise
    ``ValueError("kvloom::latent_attention: <argument> ...")``."""
    if products is None:
        products = default_products() if q.dtype is torch.bfloat16 else "float32"
    out: torch.Tensor = LATENT_ATTENTION.call(q, cache, block_tables, seq_lens, query_start, query_lens,
                                              value_dim, scale, products)
    return out


# ---- the rotary part of queries and keys ------------------------------------------------
LATENT_ROTARY = NativeOp(
    "latent_rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved) -> Tensor",
    library="latent_attention",
    native="kvloom_latent_rotary(x, Tensor out, cos, sin, int tokens, int heads, int dim, int32 interleaved, "
           "int32 dtype) -> ()",
    tensors={"x": TensorSpec(3, ACTIVATIONS), "cos": TensorSpec(2, (torch.float32,)),
             "sin": TensorSpec(2, (torch.float32,))},
)


@LATENT_ROTARY.check
def _latent_rotary_check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> None:
    if x.shape[2] % 2:
        raise LATENT_ROTARY.error("x", f"must have an even rotary width, got {x.shape[2]}")
    tables = (x.shape[0], x.shape[2])
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != tables:
            raise LATENT_ROTARY.error(name, f"must be [tokens, rotary width] = {list(tables)}, got {list(table.shape)}")


@LATENT_ROTARY.implementation
def _latent_rotary_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    out = torch.empty_like(x)
    LATENT_ROTARY.function()(x.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0], x.shape[1],
                             x.shape[2], int(interleaved), _DTYPE_CODES[x.dtype])
    return out


@LATENT_ROTARY.fake
def _latent_rotary_fake(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return torch.empty_like(x)


def latent_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [tokens, heads, dim] (contiguous, float32 or bf16) rotated at its tokens' angles
    (cos, sin: [tokens, dim] float32, ``cat(freqs, freqs)``) in float32, rounded once to x's
    dtype, the pairs adjacent (``interleaved``) or halves apart, the output de-interleaved:
    models/deepseek.py's ``rotate``, bit for bit, in one call."""
    out: torch.Tensor = LATENT_ROTARY.call(x, cos, sin, interleaved)
    return out
