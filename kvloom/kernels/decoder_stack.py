"""Every decoder layer of a Llama-family model in one native call
(kvloom/csrc/decoder_stack.cpp): the same kernels as the module path, walked in C.

``DecoderStackKernels`` holds the entry points of those kernels (``rms_norm``,
``gemm_bf16``, ``rotary_``, ``write_kv_paired``, ``paged_attention``, ``silu_and_mul``),
which the C walk calls in the module path's order; :func:`run` checks what the walk
will read and write (dtypes, shapes, contiguity of every tensor, once per forward
instead of once per kernel) and calls it. The weight table is built by
kvloom/models/decoder_stack.py from the model's checked, packed tensors, which it keeps
alive. As for the attention kernel, the index arrays are the caller's contract (see
kernels/paged_attention.py).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvloom.kernels import cpu_ops, gemm, paged_attention, shm_collectives
from kvloom.kernels.native_op import NativeFunction, NativeOp

_SCRATCH = NativeFunction("decoder_stack", "kvloom_decoder_stack_scratch(int tokens, int hidden_size, int q_size, "
                                           "int kv_size, int intermediate) -> int")
_STACK = NativeFunction(
    "decoder_stack",
    "kvloom_decoder_stack(Tensor kernels, Tensor weights, int num_layers, Tensor residual, Tensor hidden, "
    "Tensor scratch, Tensor kv_caches, int num_blocks, Tensor cos, Tensor sin, Tensor slots, Tensor block_tables, "
    "int max_blocks, Tensor seq_lens, Tensor query_start, Tensor query_lens, int num_seqs, int tokens, "
    "int hidden_size, int num_heads, int num_kv_heads, int head_dim, int intermediate, int block_size, "
    "float eps, float scale, int32 isa, int32 num_threads, Tensor reduce, int split_seqs, "
    "int kv_prefetch_bytes) -> int32")

# A layer's row of the weight table, in decoder_stack.cpp's `Weight` order.
WEIGHT_COLUMNS = ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "gate_up_bias",
                  "down", "down_bias")


def available() -> bool:
    """Whether decoder_stack.cpp and every kernel it walks build here."""
    return (_STACK.available() and cpu_ops.available() and gemm.GEMM.available()
            and paged_attention.available())


def _address(op: NativeOp | NativeFunction, variant: str = "") -> int:
    address = ctypes.cast(op.function(variant), ctypes.c_void_p).value
    assert address is not None, f"kvloom::{op.name} has no entry point"
    return address


def kernel_table(all_reduce: bool = False) -> torch.Tensor:
    """The entry points the walk calls, [7] int64, in decoder_stack.cpp's `Kernel` order;
    ``all_reduce``: with the shared-memory all-reduce (tensor parallel), else 0 there."""
    reduce = ctypes.cast(shm_collectives.ALL_REDUCE_STACK.function(), ctypes.c_void_p).value if all_reduce else 0
    return torch.tensor([_address(cpu_ops.RMS_NORM, "bf16"), _address(gemm.GEMM_SIDE), _address(cpu_ops.ROTARY, "bf16"),
                         _address(paged_attention.WRITE_KV_PAIRED), _address(paged_attention.PAGED_ATTENTION),
                         _address(cpu_ops.SILU_AND_MUL, "bf16"), reduce or 0], dtype=torch.int64)


@dataclass(frozen=True, slots=True)
class StackShape:
    """The model's sizes the walk needs (one per model)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    isa: str  # the GEMM path of every matmul (kernels/gemm.py)


@dataclass(frozen=True, slots=True)
class StackRows:
    """The step's sequences, as the attention kernel reads them (int32, contiguous)."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # [num_seqs]
    query_start: torch.Tensor  # [num_seqs]
    query_lens: torch.Tensor  # [num_seqs]


def _fail(argument: str, message: str) -> ValueError:
    return ValueError(f"kvloom decoder_stack: {argument} {message}")


def _check(name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if (tensor.dtype != dtype or tuple(tensor.shape) != shape or not tensor.is_contiguous()
            or tensor.device.type != "cpu"):
        raise _fail(name, f"must be a contiguous {list(shape)} {dtype} CPU tensor, got {list(tensor.shape)} "
                          f"{tensor.dtype} on {tensor.device}{'' if tensor.is_contiguous() else ', not contiguous'}")


def scratch_elements(shape: StackShape, tokens: int) -> int:
    """bf16 elements of the walk's scratch for ``tokens`` rows."""
    return int(_SCRATCH.function()(tokens, shape.hidden_size, shape.num_heads * shape.head_dim,
                                   shape.num_kv_heads * shape.head_dim, shape.intermediate))


def run(kernels: torch.Tensor, weights: torch.Tensor, shape: StackShape, residual: torch.Tensor,
        kv_caches: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, rows: StackRows,
        scale: float, scratch: torch.Tensor | None = None, reduce: torch.Tensor | None = None,
        split_seqs: int = 0, kv_prefetch_bytes: int = 0) -> torch.Tensor:
    """Run every layer over ``residual`` ([tokens, hidden] bf16, the embeddings; updated
    in place into the stream before the last layer's output) and return that output,
    [tokens, hidden]: the caller's final norm adds it. ``kv_caches``: the whole pool
    [layers, 2, blocks, block_size, kv_heads, head_dim] in the paired layout.
    ``scratch``: a bf16 buffer of at least ``scratch_elements`` to reuse (else one is
    allocated). ``reduce``: under tensor parallel, the shared-memory all-reduce's
    context (kernels/shm_collectives.py ``CONTEXT_FIELDS``; the kernel table must hold
    its entry point): ``hidden`` is summed over the ranks after the o and down
    projections. ``split_seqs``: 0 for one walk; else two concurrent walks, the first
    ``split_seqs`` sequences and the rest, on half the threads each (no reduce, an even
    thread count; the result is the same bit for bit). ``kv_prefetch_bytes``: how much of
    each layer's KV a walk fetches into cache during the matmuls before its attention
    (0: none; csrc/decoder_stack.cpp says where it pays; the same result bit for bit)."""
    tokens = residual.shape[0]
    bf16 = torch.bfloat16
    _check("kernels", kernels, torch.int64, (7,))
    if reduce is not None:
        _check("reduce", reduce, torch.int64, (len(shm_collectives.CONTEXT_FIELDS),))
        if int(kernels[6]) == 0:
            raise _fail("kernels", "have no all-reduce entry point, but a reduce context was given")
    _check("weights", weights, torch.int64, (shape.num_layers, len(WEIGHT_COLUMNS)))
    _check("residual", residual, bf16, (tokens, shape.hidden_size))
    if kv_caches.dim() != 6:
        raise _fail("kv_caches", f"must be [layers, 2, blocks, block_size, kv_heads, head_dim], got "
                                 f"{list(kv_caches.shape)}")
    num_blocks, block_size = kv_caches.shape[2], kv_caches.shape[3]
    _check("kv_caches", kv_caches, bf16,
           (shape.num_layers, 2, num_blocks, block_size, shape.num_kv_heads, shape.head_dim))
    if not paged_attention.paired_layout(shape.head_dim, block_size):
        raise _fail("kv_caches", f"of block size {block_size} and head_dim {shape.head_dim} has no paired layout here")
    _check("cos", cos, torch.float32, (tokens, shape.head_dim))
    _check("sin", sin, torch.float32, (tokens, shape.head_dim))
    _check("slots", slots, torch.int64, (tokens,))
    num_seqs = rows.block_tables.shape[0]
    _check("block_tables", rows.block_tables, torch.int32, (num_seqs, rows.block_tables.shape[1]))
    for name in ("seq_lens", "query_start", "query_lens"):
        _check(name, getattr(rows, name), torch.int32, (num_seqs,))
    threads = torch.get_num_threads()
    if split_seqs and not (0 < split_seqs < num_seqs and threads >= 2 and threads % 2 == 0 and reduce is None):
        raise _fail("split_seqs", f"must be 0, or within (0, {num_seqs}) with an even thread count (have "
                                  f"{threads}) and no reduce context, got {split_seqs}")
    if kv_prefetch_bytes < 0:
        raise _fail("kv_prefetch_bytes", f"must be >= 0, got {kv_prefetch_bytes}")
    needed = scratch_elements(shape, tokens)
    if scratch is None:
        scratch = torch.empty(needed, dtype=bf16)
    elif scratch.dtype != bf16 or scratch.dim() != 1 or scratch.numel() < needed or not scratch.is_contiguous():
        raise _fail("scratch", f"must be a contiguous 1-D bf16 tensor of at least {needed} elements, got "
                               f"{list(scratch.shape)} {scratch.dtype}")
    hidden = torch.empty_like(residual)
    status = _STACK.function()(
        kernels.data_ptr(), weights.data_ptr(), shape.num_layers, residual.data_ptr(), hidden.data_ptr(),
        scratch.data_ptr(), kv_caches.data_ptr(), num_blocks, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
        rows.block_tables.data_ptr(), rows.block_tables.shape[1], rows.seq_lens.data_ptr(),
        rows.query_start.data_ptr(), rows.query_lens.data_ptr(), num_seqs, tokens, shape.hidden_size,
        shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate, block_size, shape.eps, scale,
        gemm.isa_code(shape.isa), threads, 0 if reduce is None else reduce.data_ptr(), split_seqs,
        kv_prefetch_bytes)
    if status == -2:
        raise RuntimeError("kvloom decoder_stack: tensor-parallel all-reduce: another rank of this host died")
    if status == -1:
        raise RuntimeError("kvloom decoder_stack: tensor-parallel all-reduce: timed out waiting for another rank")
    if status != 0:
        raise RuntimeError(f"kvloom decoder_stack: layer {status - 1}'s matmul refused the {shape.isa!r} path "
                           f"(this CPU runs {gemm.supported_isas()})")
    return hidden
