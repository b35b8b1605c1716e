"""The CUDA backend's fused layer ops in Triton (kvloom/kernels/triton_ops.py) against
models/ops.py's PyTorch reference chains: RMSNorm alone and with the residual add (the
stream updated in place), silu-and-mul, rotary in place on the q | k heads of a fused
row. Without a GPU they run in Triton's interpreter on CPU (tests/conftest.py);
``pytest -k triton`` selects them."""

from __future__ import annotations

import pytest
import torch

from kvloom.models import ops

pytest.importorskip("triton", reason="the CUDA backend's kernels need the triton package (pip install triton)")

from kvloom.kernels import triton_ops  # noqa: E402 - after the skip: it imports triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# bf16: the kernels round once where the reference rounds after each op, and Triton's
# interpreter (triton 3.9) truncates float32 -> bf16 where a GPU rounds to nearest:
# within two steps of bf16 at the operands' size (about 3 here).
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=5e-2, rtol=2e-2)}
ROUNDS_TO_NEAREST = torch.cuda.is_available()  # not the interpreter
DTYPES = [torch.float32, torch.bfloat16]


def data(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n"), [(1, 576), (7, 100)])
def test_triton_rms_norm_and_fused_residual(dtype: torch.dtype, rows: int, n: int) -> None:
    x, residual, weight = data((rows, n), dtype, 1), data((rows, n), dtype, 2), data((n,), dtype, 3)
    torch.testing.assert_close(triton_ops.rms_norm(x, weight, 1e-5), ops.rms_norm_reference(x, weight, 1e-5),
                               **TOLERANCE[dtype])
    ours, theirs = residual.clone(), residual.clone()
    expected = ops.rms_norm_reference(x, weight, 1e-5, theirs)
    torch.testing.assert_close(triton_ops.rms_norm(x, weight, 1e-5, ours), expected, **TOLERANCE[dtype])
    if ROUNDS_TO_NEAREST or dtype == torch.float32:
        assert torch.equal(ours, theirs)  # the stream: one addition, rounded once, in both
    else:  # the interpreter's truncation: at most one step of bf16 below
        torch.testing.assert_close(ours, theirs, atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n"), [(3, 1536), (5, 70)])
def test_triton_silu_and_mul(dtype: torch.dtype, rows: int, n: int) -> None:
    gate_up = data((rows, 2 * n), dtype, 4)
    torch.testing.assert_close(triton_ops.silu_and_mul(gate_up), ops.silu_and_mul_reference(gate_up),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_rotary_rotates_only_the_named_heads(dtype: torch.dtype) -> None:
    tokens, heads, kv_heads, head_dim = 6, 4, 2, 32
    qkv = data((tokens, (heads + 2 * kv_heads) * head_dim), dtype, 5)  # q | k | v of a fused projection
    angles = torch.arange(tokens, dtype=torch.float32)[:, None] * torch.linspace(0.1, 1.0, head_dim // 2)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(DEVICE)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(DEVICE)
    ours, theirs = qkv.clone(), qkv.clone()
    triton_ops.rotary_(ours, heads + kv_heads, head_dim, cos, sin)
    ops.rotary_reference_(theirs, heads + kv_heads, head_dim, cos, sin)
    torch.testing.assert_close(ours, theirs, **TOLERANCE[dtype])
    assert torch.equal(ours[:, (heads + kv_heads) * head_dim:], qkv[:, (heads + kv_heads) * head_dim:])  # v untouched
