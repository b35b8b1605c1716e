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
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvloom import native

logger = logging.getLogger(__name__)
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_native: ctypes.CDLL | None = None
_native_tried = False
# (op name, dtype) -> its ctypes function: looked up once, not on every layer call.
_kernels: dict[tuple[str, torch.dtype], Callable[..., None]] = {}


def _library() -> ctypes.CDLL | None:
    global _native, _native_tried
    if not _native_tried:
        _native_tried = True
        try:
            library = native.load("cpu_ops")
        except native.KernelUnavailable as error:
            logger.warning("fused CPU ops unavailable, using PyTorch ops: %s", error)
        else:
            pointer, i64 = ctypes.c_void_p, ctypes.c_int64
            for suffix in _SUFFIX.values():
                _declare(library, f"kvloom_rms_norm_{suffix}", [pointer] * 4 + [i64, i64, ctypes.c_float])
                _declare(library, f"kvloom_silu_and_mul_{suffix}", [pointer] * 2 + [i64, i64])
                _declare(library, f"kvloom_rotary_{suffix}", [pointer, i64, pointer, pointer, i64, i64, i64])
            _native = library
    return _native


def _declare(library: ctypes.CDLL, name: str, argtypes: list[type]) -> None:
    function = getattr(library, name)
    function.restype = None
    function.argtypes = argtypes


def _kernel(name: str, x: torch.Tensor) -> Callable[..., None] | None:
    """The fused C++ op for x's dtype, or None where the reference must run."""
    if x.device.type != "cpu" or x.dtype not in _SUFFIX:
        return None
    kernel = _kernels.get((name, x.dtype))
    if kernel is None:
        library = _library()
        if library is None:
            return None
        kernel = _kernels[(name, x.dtype)] = getattr(library, f"kvloom_{name}_{_SUFFIX[x.dtype]}")
    return kernel


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
