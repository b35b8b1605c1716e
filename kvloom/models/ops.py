"""The elementwise ops of a decoder layer: a pure-PyTorch reference and fused C++ ones.

``rms_norm``, ``silu_and_mul`` and ``rotary_`` dispatch on the tensor's device: on CPU
they run ``kvloom/csrc/cpu_ops.cpp`` (one pass, one call) when it builds here, else
the reference chains below, which also serve every other device. Why: at decode batch
sizes a layer ran about 35 small PyTorch ops whose dispatch cost more than their
arithmetic (profile in docs/benchmarks.md). tests/models/test_ops.py holds the fused
ops to the reference.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvloom import native

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_POINTER, _INT64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = {
    "rms_norm": [_POINTER] * 4 + [_INT64, _INT64, ctypes.c_float],
    "silu_and_mul": [_POINTER] * 2 + [_INT64, _INT64],
    "rotary": [_POINTER, _INT64, _POINTER, _POINTER, _INT64, _INT64, _INT64],
}


@functools.cache  # looked up once per (op, dtype), not on every layer call
def _function(name: str, dtype: torch.dtype) -> Callable[..., None] | None:
    library = native.load_optional("cpu_ops")
    if library is None:
        return None
    function = getattr(library, f"kvloom_{name}_{_SUFFIX[dtype]}")
    function.restype = None
    function.argtypes = _ARGTYPES[name]
    return function


def _kernel(name: str, x: torch.Tensor) -> Callable[..., None] | None:
    """The fused C++ op for x's dtype, or None where the reference must run."""
    if x.device.type != "cpu" or x.dtype not in _SUFFIX:
        return None
    return _function(name, x.dtype)


# ---- RMSNorm (optionally fused with the residual add) --------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * x / rms(x), in float32 then cast, as Hugging Face computes it.

    With ``residual``: first ``residual += x`` (in place, in x's dtype), then normalise
    that sum; the caller keeps ``residual`` as the new residual stream. x: [rows, n].
    """
    kernel = _kernel("rms_norm", x)
    if kernel is None or not (x.is_contiguous() and weight.dtype == x.dtype):
        return rms_norm_reference(x, weight, eps, residual)
    if residual is not None:
        assert residual.is_contiguous() and residual.shape == x.shape and residual.dtype == x.dtype
    out = torch.empty_like(x)
    kernel(x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(),
           out.data_ptr(), x.shape[0], x.shape[-1], eps)
    return out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
    if residual is not None:
        residual.add_(x)
        x = residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


# ---- gated MLP activation ------------------------------------------------------------
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim: [rows, 2n] -> [rows, n]."""
    kernel = _kernel("silu_and_mul", gate_up)
    if kernel is None or not gate_up.is_contiguous():
        return silu_and_mul_reference(gate_up)
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype, device=gate_up.device)
    kernel(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
    return out


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- rotary embedding ----------------------------------------------------------------
def rotary_(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate, in place, the first ``num_heads`` head vectors of each row of ``x``.

    x: [tokens, width] whose rows start with the heads to rotate (the fused qkv output:
    q's heads then k's, so one call rotates both). cos/sin: [tokens, head_dim] float32.
    """
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError(f"rotary tables must be float32, got {cos.dtype} and {sin.dtype}")
    kernel = _kernel("rotary", x)
    if kernel is None or x.stride(-1) != 1 or not (cos.is_contiguous() and sin.is_contiguous()):
        rotary_reference_(x, num_heads, head_dim, cos, sin)
        return
    kernel(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), x.shape[0], num_heads, head_dim)


def rotary_reference_(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor,
                      sin: torch.Tensor) -> None:
    heads = x[:, :num_heads * head_dim].unflatten(-1, (num_heads, head_dim))
    c, s = cos.to(x.dtype).unsqueeze(1), sin.to(x.dtype).unsqueeze(1)
    half = head_dim // 2
    rotated = torch.cat((-heads[..., half:], heads[..., :half]), dim=-1)
    heads.copy_(heads * c + rotated * s)
