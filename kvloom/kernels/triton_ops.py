"""A decoder layer's elementwise ops in Triton, for CUDA: residual add + RMSNorm,
silu-and-mul and rotary embedding, each one pass over its rows (one launch where the
PyTorch chains take several). models/ops.py dispatches to them for CUDA tensors;
tests/models/test_triton_ops.py holds them to its reference chains (in Triton's
interpreter on CPU, natively on a GPU). Arithmetic is float32, rounded once to the
tensor's dtype; the reference rounds after each PyTorch op, so half-precision results
agree within a rounding step, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x, residual, weight, out, n, eps, stride_x, stride_r, stride_o,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    values = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # the stream += x, in its dtype, and the sum is what is normalised
        summed = (tl.load(residual + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
                  + values.to(tl.float32)).to(values.dtype)
        tl.store(residual + row * stride_r + cols, summed, mask=mask)
        values = summed
    x32 = values.to(tl.float32)
    normed = (x32 * tl.rsqrt(tl.sum(x32 * x32, 0) / n + eps)).to(values.dtype)
    scaled = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32) * normed.to(tl.float32)
    tl.store(out + row * stride_o + cols, scaled.to(values.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """models/ops.py's ``rms_norm``: x [rows, n]; with ``residual``, ``residual += x``
    in place first and the sum normalised."""
    rows, n = x.shape
    out = torch.empty_like(x)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must have x's shape {tuple(x.shape)}")
    if rows:
        _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, n, eps, x.stride(0),
                                  residual.stride(0) if residual is not None else 0, out.stride(0),
                                  HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n))
    return out


@triton.jit
def _silu_and_mul_kernel(gate_up, out, n, stride_in, stride_out, BLOCK: tl.constexpr):
    row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gate_up + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up + row * stride_in + n + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * stride_out + cols, (gate * tl.sigmoid(gate) * up).to(out.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up]: [rows, 2n] -> [rows, n]."""
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0),
                                                            BLOCK=block)
    return out


@triton.jit
def _rotary_kernel(x, cos, sin, stride_x, stride_c, head_dim, HALF_PAD: tl.constexpr):
    """Program (token, head): rotate-half on the head's vector, in place."""
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    half = head_dim // 2
    i = tl.arange(0, HALF_PAD)
    mask = i < half
    base = x + token * stride_x + head * head_dim
    first = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(base + half + i, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos + token * stride_c + i, mask=mask, other=0.0)
    c2 = tl.load(cos + token * stride_c + half + i, mask=mask, other=0.0)
    s1 = tl.load(sin + token * stride_c + i, mask=mask, other=0.0)
    s2 = tl.load(sin + token * stride_c + half + i, mask=mask, other=0.0)
    tl.store(base + i, (first * c1 - second * s1).to(x.dtype.element_ty), mask=mask)
    tl.store(base + half + i, (second * c2 + first * s2).to(x.dtype.element_ty), mask=mask)


def rotary_(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """models/ops.py's ``rotary_``: the first ``num_heads`` head vectors of each row of
    x [tokens, width] rotated in place; cos/sin [tokens, head_dim] float32."""
    tokens = x.shape[0]
    if tokens:
        _rotary_kernel[(tokens, num_heads)](x, cos, sin, x.stride(0), cos.stride(0), head_dim,
                                            HALF_PAD=triton.next_power_of_2(head_dim // 2))
