"""The elementwise ops of a decoder layer: a pure-PyTorch reference and fused C++ ones.

``rms_norm``, ``silu_and_mul`` and ``rotary_`` dispatch on the tensor's device: on CPU
they run the ops ``kvloom::rms_norm``, ``kvloom::silu_and_mul`` and ``kvloom::rotary_``
(kvloom/kernels/cpu_ops.py: ``kvloom/csrc/cpu_ops.cpp``, one pass, one call) when it
builds here; on CUDA the Triton kernels of kvloom/kernels/triton_ops.py when triton is
installed; else the reference chains below, which also serve every other device and
layouts the ops do not take. Why: at decode batch sizes a layer ran about 35 small
PyTorch ops whose dispatch cost more than their arithmetic (profile in
docs/benchmarks.md). tests/models/test_ops.py holds the fused ops to the reference.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from kvloom.kernels import cpu_ops


@functools.cache  # asked once: whether cpu_ops.cpp builds here
def _built() -> bool:
    return cpu_ops.available()


def _native(x: torch.Tensor) -> bool:
    """Whether the fused C++ op serves x's device and dtype (else the reference runs)."""
    return x.is_cpu and x.dtype in cpu_ops.ACTIVATIONS and _built()


@functools.cache  # asked once: whether the Triton kernels can load (CUDA only)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernel serves x (a CUDA tensor with unit stride in its rows)."""
    return x.is_cuda and x.stride(-1) == 1 and _triton_installed()


# ---- RMSNorm (optionally fused with the residual add) --------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * x / rms(x), in float32 then cast, as Hugging Face computes it.

    With ``residual``: first ``residual += x`` (in place, in x's dtype), then normalise
    that sum; the caller keeps ``residual`` as the new residual stream. x: [rows, n].
    """
    if _triton(x) and x.dim() == 2 and (residual is None or residual.stride(-1) == 1):
        from kvloom.kernels import triton_ops
        return triton_ops.rms_norm(x, weight, eps, residual)
    if not (_native(x) and x.is_contiguous() and weight.dtype == x.dtype):
        return rms_norm_reference(x, weight, eps, residual)
    return cpu_ops.rms_norm(x, residual, weight, eps)  # checks residual: a mismatch raises


def _normalized(x: torch.Tensor, eps: float, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.dtype]:
    """x / rms(x) in float32 (after ``residual += x`` in place, of that sum), and x's dtype."""
    if residual is not None:
        residual.add_(x)
        x = residual
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps), x.dtype


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
    x32, dtype = _normalized(x, eps, residual)
    return weight * x32.to(dtype)


def rms_norm_scaled_in_float32(x: torch.Tensor, weight: torch.Tensor, eps: float,
                               residual: torch.Tensor | None = None, offset: float = 0.0) -> torch.Tensor:
    """x / rms(x) * (offset + weight), the product in float32 before the cast (Llama's
    casts first, then scales), as transformers computes Gemma's norm (offset 1) and OLMo 2's
    (offset 0); ``residual`` as :func:`rms_norm`'s."""
    if not (_native(x) and x.dim() == 2 and x.is_contiguous() and weight.dtype == x.dtype):
        return rms_norm_scaled_in_float32_reference(x, weight, eps, residual, offset)
    return cpu_ops.rms_norm_scaled(x, residual, weight, eps, offset)


def rms_norm_scaled_in_float32_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                                         residual: torch.Tensor | None = None, offset: float = 0.0) -> torch.Tensor:
    x32, dtype = _normalized(x, eps, residual)
    return (x32 * (offset + weight.float())).to(dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """LayerNorm with a weight and a bias, in float32 before the cast; ``residual`` as
    :func:`rms_norm`'s."""
    if not (_native(x) and x.dim() == 2 and x.is_contiguous() and weight.dtype == x.dtype
            and bias.dtype == x.dtype):
        return layer_norm_reference(x, weight, bias, eps, residual)
    return cpu_ops.layer_norm(x, residual, weight, bias, eps)


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                         residual: torch.Tensor | None = None) -> torch.Tensor:
    if residual is not None:
        residual.add_(x)
        x = residual
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


# ---- gated MLP activation ------------------------------------------------------------
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim: [rows, 2n] -> [rows, n]."""
    if _triton(gate_up) and gate_up.dim() == 2:
        from kvloom.kernels import triton_ops
        return triton_ops.silu_and_mul(gate_up)
    if not (_native(gate_up) and gate_up.is_contiguous()):
        return silu_and_mul_reference(gate_up)
    return cpu_ops.silu_and_mul(gate_up)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU (the tanh approximation: transformers' gelu_pytorch_tanh) of gate times up,
    Gemma's GeGLU: [rows, 2n] -> [rows, n]."""
    if not (_native(gate_up) and gate_up.dim() == 2 and gate_up.is_contiguous()):
        return gelu_tanh_and_mul_reference(gate_up)
    return cpu_ops.gelu_tanh_and_mul(gate_up)


def gelu_tanh_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# The un-gated MLP's activations by form: the fused CPU kernel, and the PyTorch reference.
_PLAIN_NATIVE = {"gelu_tanh": cpu_ops.gelu_tanh, "gelu_erf": cpu_ops.gelu_erf, "relu": cpu_ops.relu,
                 "relu2": cpu_ops.relu2}
_PLAIN_REFERENCE = {"gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu_erf": F.gelu, "relu": torch.relu,
                    "relu2": lambda x: torch.square(torch.relu(x))}


def plain_activation(x: torch.Tensor, form: str) -> torch.Tensor:
    """The un-gated MLP's activation of x in ``form`` (PLAIN_FORMS), fused on CPU: GELU's
    tanh form, ReLU and its square always, GELU's exact form in bf16 (its erfc is within
    float32's step of torch's, not bit-equal, and float32 runs are the ones held to
    transformers at float32's tolerance)."""
    if _native(x) and x.dim() == 2 and x.is_contiguous() and (form != "gelu_erf" or x.dtype == torch.bfloat16):
        return _PLAIN_NATIVE[form](x)
    return _PLAIN_REFERENCE[form](x)


# ---- rotary embedding ----------------------------------------------------------------
def rotary_(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate, in place, the first ``num_heads`` head vectors of each row of ``x``.

    x: [tokens, width] whose rows start with the heads to rotate (the fused qkv output:
    q's heads then k's, so one call rotates both). cos/sin: [tokens, rotary_dim] float32:
    each head's first rotary_dim dimensions turn (head_dim; Phi-4's and Bamba's a part),
    the rest pass.
    """
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError(f"rotary tables must be float32, got {cos.dtype} and {sin.dtype}")
    if _triton(x) and cos.is_contiguous() and sin.is_contiguous() and cos.shape[-1] == head_dim:
        from kvloom.kernels import triton_ops
        triton_ops.rotary_(x, num_heads, head_dim, cos, sin)
        return
    if not (_native(x) and x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()):
        rotary_reference_(x, num_heads, head_dim, cos, sin)
        return
    cpu_ops.rotary_(x, num_heads, head_dim, cos, sin)


def rotary_reference_(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor,
                      sin: torch.Tensor) -> None:
    """``rotary_`` in PyTorch, in x's dtype as transformers computes it."""
    rotary = cos.shape[-1]
    heads = x[:, :num_heads * head_dim].unflatten(-1, (num_heads, head_dim))[..., :rotary]  # a view
    c, s = cos.to(x.dtype).unsqueeze(1), sin.to(x.dtype).unsqueeze(1)
    half = rotary // 2
    rotated = torch.cat((-heads[..., half:], heads[..., :half]), dim=-1)
    heads.copy_(heads * c + rotated * s)
