"""Paged attention (kvloom/csrc/paged_attention.cpp) as ``kvloom::paged_attention`` and
``kvloom::write_kv_paired``, and the layout query :func:`paired_layout`.

A layer's KV cache is [2, num_blocks, block_size, kv_heads, head_dim]: token-major
blocks, or for bf16 caches of shapes the AVX2 and AVX-512 paths serve, the paired layout
(K as [kv_head, head_dim / 2, block_size] words of two bf16, V as [kv_head,
block_size / 2, head_dim] words; see attention/cpu_paged.py and the kernel's comments).
Only the kernel writes the paired layout (``write_kv_paired``); the token-major one is
written by PyTorch (attention/base.py).

The index arrays are the caller's contract, not checked here (that would read them on
every call): block ids below num_blocks, ``seq_lens`` within each block table,
``query_start + query_lens`` within q's rows, slots below num_blocks * block_size.
"""

from __future__ import annotations

import functools

import torch

from kvloom.kernels import gemm
from kvloom.kernels.native_op import NativeFunction, NativeOp, TensorSpec, dtype_name

ACTIVATIONS = (torch.float32, torch.bfloat16)
_INT32 = (torch.int32,)

_PAIRED_LAYOUT = NativeFunction("paged_attention", "kvloom_paired_layout(int head_dim, int block_size) -> int32")
_PAIRED_ISA = NativeFunction("paged_attention", "kvloom_paired_attention_isa(int32 want) -> int32")
# The paired layout's paths, worst to best (paged_attention.cpp's PairedPath, by index):
# vdpbf16ps's arithmetic as two FMAs per pair on 8 lanes (AVX2, csrc/paired_avx2.h) and
# on 16 (AVX-512 without AVX512-BF16), vdpbf16ps, AMX tiles: one for each GEMM path.
PAIRED_ISAS = gemm.ISAS
_CASCADE_MEMBERS = NativeFunction(
    "paged_attention", "kvloom_paired_cascade_members(Tensor block_tables, int max_blocks, Tensor seq_lens, "
                       "Tensor query_lens, int num_seqs, int block_size) -> int")


def available() -> bool:
    """Whether paged_attention.cpp builds here."""
    return PAGED_ATTENTION.available()


def load() -> None:
    """Build (once) and load paged_attention.cpp, and choose the paired layout's path
    (:func:`paired_isa`); KernelUnavailable where it cannot be built."""
    _PAIRED_LAYOUT.function()
    paired_isa()


@functools.cache  # chosen once per process, so every call takes the same path
def paired_isa() -> str | None:
    """The instructions paired-layout attention runs on (one of :data:`PAIRED_ISAS`):
    the best this build and CPU have, no better than the GEMM's path
    (``gemm.default_isa()``: AMX only where the GEMM's AMX check passed, and
    ``$KVLOOM_CPU_ISA`` caps both); None where the paired layout is not built. One path
    for the whole process: AMX and vdpbf16ps agree to rounding, not bit for bit, and a
    query's result must not depend on which path served it."""
    return set_paired_isa(gemm.default_isa() or PAIRED_ISAS[0])


def set_paired_isa(isa: str) -> str | None:
    """Switch paired-layout attention to the best path up to ``isa`` (one of
    :data:`PAIRED_ISAS`) that this build has, and return it (None where the paired
    layout is not built). For tests and benchmarks that compare the paths: the engine
    keeps :func:`paired_isa`'s choice."""
    if isa not in PAIRED_ISAS:
        raise ValueError(f"paired attention runs on one of {PAIRED_ISAS}, got {isa!r}")
    path = int(_PAIRED_ISA.function()(PAIRED_ISAS.index(isa)))
    return PAIRED_ISAS[path] if path >= 0 else None


@functools.cache  # one answer per shape for the process: the build decides it
def paired_layout(head_dim: int, block_size: int) -> bool:
    """Whether bf16 caches of this shape use the paired layout (this CPU and build)."""
    return bool(_PAIRED_LAYOUT.function()(head_dim, block_size))


def cascade_members(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_lens: torch.Tensor,
                    block_size: int) -> int:
    """How many of these sequences (int32 arrays as for :func:`paged_attention`) the
    paired kernel walks partly together with others over shared leading blocks (0 where
    the paired layout is not built). Tests use it to know the shared walk ran."""
    tables, seq_lens, query_lens = (t.to(torch.int32).contiguous() for t in (block_tables, seq_lens, query_lens))
    return int(_CASCADE_MEMBERS.function()(tables.data_ptr(), tables.shape[1], seq_lens.data_ptr(),
                                           query_lens.data_ptr(), tables.shape[0], block_size))


def _cache_pointers(kv_cache: torch.Tensor) -> tuple[int, int]:
    """K's and V's halves of a contiguous [2, ...] cache: kv_cache[0] and kv_cache[1]."""
    k_pointer = kv_cache.data_ptr()
    return k_pointer, k_pointer + kv_cache.stride(0) * kv_cache.element_size()


def _check_cache(op: NativeOp, kv_cache: torch.Tensor, kv_heads: int, head_dim: int) -> None:
    if kv_cache.shape[0] != 2 or kv_cache.shape[3] != kv_heads or kv_cache.shape[4] != head_dim:
        raise op.error("kv_cache", f"must be [2, num_blocks, block_size, {kv_heads}, {head_dim}], "
                                   f"got {list(kv_cache.shape)}")


# ---- attention over the block tables -------------------------------------------------
# The op's own C function takes no sinks: the decoder walk (kernels/decoder_stack.py) calls
# it through its address with that signature. Calls with sinks go to _WITH_SINKS, the same
# kernel with GPT-OSS's sinks (kvloom_paged_attention is it with none).
PAGED_ATTENTION = NativeOp(
    "paged_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, Tensor query_start, "
    "Tensor query_lens, float scale, bool paired, int window, float softcap, Tensor? sinks) -> Tensor",
    library="paged_attention",
    native="kvloom_paged_attention(q, Tensor out, Tensor k_cache, Tensor v_cache, block_tables, "
           "int max_blocks, seq_lens, query_start, query_lens, int num_seqs, int num_heads, int num_kv_heads, "
           "int head_dim, int block_size, scale, window, softcap, int32 num_threads, int32 kernel) -> ()",
    tensors={"q": TensorSpec(3, like="kv_cache"), "kv_cache": TensorSpec(5, ACTIVATIONS),
             "block_tables": TensorSpec(2, _INT32), "seq_lens": TensorSpec(1, _INT32),
             "query_start": TensorSpec(1, _INT32), "query_lens": TensorSpec(1, _INT32),
             "sinks": TensorSpec(1, (torch.float32,))},
)
_WITH_SINKS = NativeFunction(
    "paged_attention",
    "kvloom_paged_attention_sinks(Tensor q, Tensor out, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
    "int max_blocks, Tensor seq_lens, Tensor query_start, Tensor query_lens, int num_seqs, int num_heads, "
    "int num_kv_heads, int head_dim, int block_size, float scale, int window, float softcap, Tensor sinks, "
    "int32 num_threads, int32 kernel) -> ()")


@PAGED_ATTENTION.check
def _paged_attention_check(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, query_start: torch.Tensor, query_lens: torch.Tensor,
                           scale: float, paired: bool, window: int = 0, softcap: float = 0.0,
                           sinks: torch.Tensor | None = None) -> None:
    kv_heads, head_dim = kv_cache.shape[3], q.shape[2]
    if window < 0:
        raise PAGED_ATTENTION.error("window", f"must be 0 (every key) or a number of keys, got {window}")
    if not softcap >= 0:
        raise PAGED_ATTENTION.error("softcap", f"must be 0 (none) or positive, got {softcap}")
    _check_cache(PAGED_ATTENTION, kv_cache, kv_heads, head_dim)
    if kv_heads == 0 or q.shape[1] % kv_heads:
        raise PAGED_ATTENTION.error("q", f"must have a multiple of kv_cache's {kv_heads} kv heads, got {q.shape[1]}")
    num_seqs = block_tables.shape[0]
    for name, array in (("seq_lens", seq_lens), ("query_start", query_start), ("query_lens", query_lens)):
        if array.shape[0] != num_seqs:
            raise PAGED_ATTENTION.error(name, f"must have one entry per block table ({num_seqs}), got {array.shape[0]}")
    # int(): the layout is decided per exact shape (a symbolic one is specialised).
    if paired and not (kv_cache.dtype is torch.bfloat16 and paired_layout(int(head_dim), int(kv_cache.shape[2]))):
        raise PAGED_ATTENTION.error("paired", f"is set, but a {list(kv_cache.shape)} "
                                              f"{dtype_name(kv_cache.dtype)} cache has no paired layout here")
    if sinks is not None and sinks.shape[0] != q.shape[1]:
        raise PAGED_ATTENTION.error("sinks", f"must hold one logit per query head, [{q.shape[1]}] float32, "
                                             f"got {list(sinks.shape)}")


# paged_attention.cpp's kernel codes: the cache's element type and layout.
_TOKEN_MAJOR_KERNEL = {torch.float32: 0, torch.bfloat16: 1}
_PAIRED_KERNEL = 2


@PAGED_ATTENTION.implementation
def _paged_attention_cpu(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, query_start: torch.Tensor, query_lens: torch.Tensor,
                         scale: float, paired: bool, window: int = 0, softcap: float = 0.0,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty_like(q)  # [tokens, heads, head_dim]
    k_cache, v_cache = _cache_pointers(kv_cache)
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    arguments = (q.data_ptr(), out.data_ptr(), k_cache, v_cache, block_tables.data_ptr(), block_tables.shape[1],
                 seq_lens.data_ptr(), query_start.data_ptr(), query_lens.data_ptr(), block_tables.shape[0],
                 q.shape[1], kv_heads, head_dim, block_size, scale, window, softcap)
    threads, kernel = torch.get_num_threads(), _PAIRED_KERNEL if paired else _TOKEN_MAJOR_KERNEL[q.dtype]
    if sinks is None:
        PAGED_ATTENTION.function()(*arguments, threads, kernel)
    else:
        _WITH_SINKS.function()(*arguments, sinks.data_ptr(), threads, kernel)
    return out


@PAGED_ATTENTION.fake
def _paged_attention_fake(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                          seq_lens: torch.Tensor, query_start: torch.Tensor, query_lens: torch.Tensor,
                          scale: float, paired: bool, window: int = 0, softcap: float = 0.0,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty_like(q)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start: torch.Tensor, query_lens: torch.Tensor, scale: float, paired: bool,
                    window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q: [tokens, heads, head_dim] over each sequence's cached keys
    through its block table ([num_seqs, max_blocks] int32); ``seq_lens``,
    ``query_start`` (first row in q) and ``query_lens``: [num_seqs] int32. ``paired``:
    the cache is in the paired layout. ``window`` > 0: a sliding window, the query at
    position p attending keys (p - window, p]. ``softcap`` > 0: each scaled score s becomes
    softcap * tanh(s / softcap) (Gemma 2's). ``sinks``: GPT-OSS's attention sinks, a
    contiguous [heads] float32 tensor of one logit per query head, each joining its
    head's softmax denominator with no value (None: none). Returns [tokens, heads, head_dim]."""
    return PAGED_ATTENTION.call(q, kv_cache, block_tables, seq_lens, query_start, query_lens, scale, paired,
                                window, softcap, sinks)


# ---- writing K/V into the paired layout ----------------------------------------------
WRITE_KV_PAIRED = NativeOp(
    "write_kv_paired(Tensor k, Tensor v, Tensor slots, Tensor(a!) kv_cache) -> ()",
    library="paged_attention",
    native="kvloom_write_kv_paired(k, int k_stride, v, int v_stride, slots, int tokens, Tensor k_cache, "
           "Tensor v_cache, int num_kv_heads, int head_dim, int block_size, int32 num_threads) -> ()",
    tensors={"k": TensorSpec(3, (torch.bfloat16,), rows=True), "v": TensorSpec(3, (torch.bfloat16,), rows=True),
             "slots": TensorSpec(1, (torch.int64,)), "kv_cache": TensorSpec(5, (torch.bfloat16,))},
)


@WRITE_KV_PAIRED.check
def _write_kv_paired_check(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, kv_cache: torch.Tensor) -> None:
    tokens, kv_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise WRITE_KV_PAIRED.error("v", f"must have k's shape {list(k.shape)}, got {list(v.shape)}")
    if slots.shape[0] != tokens:
        raise WRITE_KV_PAIRED.error("slots", f"must have one slot per token ({tokens}), got {slots.shape[0]}")
    _check_cache(WRITE_KV_PAIRED, kv_cache, kv_heads, head_dim)
    if not paired_layout(int(head_dim), int(kv_cache.shape[2])):
        raise WRITE_KV_PAIRED.error("kv_cache", f"of shape {list(kv_cache.shape)} has no paired layout here")


@WRITE_KV_PAIRED.implementation
def _write_kv_paired_cpu(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, kv_cache: torch.Tensor) -> None:
    k_cache, v_cache = _cache_pointers(kv_cache)
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    WRITE_KV_PAIRED.function()(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(), slots.shape[0], k_cache, v_cache,
        kv_heads, head_dim, block_size, torch.get_num_threads())


@WRITE_KV_PAIRED.fake
def _write_kv_paired_fake(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, kv_cache: torch.Tensor) -> None:
    return None


def write_kv_paired(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """Store k, v: [tokens, kv_heads, head_dim] bf16 (rows may be strided) at ``slots``
    ([tokens] int64) of a paired-layout cache, in place."""
    WRITE_KV_PAIRED.call(k, v, slots, kv_cache)
