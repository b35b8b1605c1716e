"""The fused C++ layer ops (kvloom/csrc/cpu_ops.cpp) against their PyTorch references,
and the references against the plain Hugging Face formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvloom.kernels import cpu_ops
from kvloom.models import ops
from kvloom.native import KernelUnavailable, load

try:
    load("cpu_ops")
    BUILT = True
except KernelUnavailable:
    BUILT = False
needs_native = pytest.mark.skipif(not BUILT, reason="no C++ compiler to build cpu_ops.cpp")

# fp32: the same formula up to summation order. bf16: the same roundings, so equal but
# for a rare last-bit difference where a float32 sum order tips a rounding.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def data(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
# 16 rows: a decode batch, its rows split over the threads
@pytest.mark.parametrize(("rows", "n"), [(1, 576), (7, 64), (16, 576), (300, 100)])
def test_rms_norm_and_fused_residual(dtype: torch.dtype, rows: int, n: int) -> None:
    x, residual, weight = data((rows, n), dtype, 1), data((rows, n), dtype, 2), data((n,), dtype, 3)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), hf_rms_norm(x, weight, 1e-5), **TOLERANCE[dtype])
    ours_residual, ref_residual = residual.clone(), residual.clone()
    ours = ops.rms_norm(x, weight, 1e-5, ours_residual)
    ref = ops.rms_norm_reference(x, weight, 1e-5, ref_residual)
    assert torch.equal(ours_residual, ref_residual)  # one rounded add: exact
    assert torch.equal(ref_residual, residual + x)
    torch.testing.assert_close(ours, ref, **TOLERANCE[dtype])
    torch.testing.assert_close(ref, hf_rms_norm(residual + x, weight, 1e-5), **TOLERANCE[dtype])


def bf16(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


@needs_native
def test_the_residual_add_rounds_every_class_of_value_as_torch() -> None:
    # x + residual landing on each case of the rounding rule (csrc/simd.h: bf16_pack,
    # whose one-instruction path flushes denormals and keeps NaN payloads), at lanes
    # spread over a 576-wide row of ordinary values: ties to even both ways, denormal
    # sums, NaN with payloads (quiet and signalling), infinities and an overflow to inf.
    # (bits of x, bits of residual): 1.0 + 2^-8 (a tie, down to 1.0), 1.00390625 + 2^-8
    # (a tie, up), two denormals, a normal minus a normal landing below the smallest
    # normal, NaNs plus 1, inf plus 1, the largest bf16 plus itself (inf).
    cases = [(0x3F80, 0x3B80), (0x3F81, 0x3B80), (0x0001, 0x0002), (0x0081, 0x8080), (0x7FC5, 0x3F80),
             (0xFFA1, 0x3F80), (0x7F81, 0x3F80), (0x7F80, 0x3F80), (0xFF80, 0x3F80), (0x7F7F, 0x7F7F), (0x8000, 0x0000)]
    x, residual = data((3, 576), torch.bfloat16, 4), data((3, 576), torch.bfloat16, 5)
    for i, (xb, rb) in enumerate(cases):
        row, column = i % 3, 37 * i + 5
        x[row, column], residual[row, column] = bf16([xb]), bf16([rb])
    expected = (residual.float() + x.float()).to(torch.bfloat16)  # torch: nearest even
    # NaN: torch's vector conversion writes 0xffff, the kernels' rule (simd.h) 0x7fc0.
    expected[expected.isnan()] = bf16([0x7FC0])
    ours = residual.clone()
    ops.rms_norm(x, torch.ones(576, dtype=torch.bfloat16), 1e-5, ours)
    assert torch.equal(ours.view(torch.int16), expected.view(torch.int16))  # bits, so NaN == NaN


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n"), [(1, 1536), (5, 17), (16, 1536), (70, 1024)])
def test_silu_and_mul(dtype: torch.dtype, rows: int, n: int) -> None:
    gate_up = data((rows, 2 * n), dtype, 4)
    expected = F.silu(gate_up[:, :n]) * gate_up[:, n:]
    torch.testing.assert_close(ops.silu_and_mul(gate_up), expected, **TOLERANCE[dtype])
    torch.testing.assert_close(ops.silu_and_mul_reference(gate_up), expected, atol=0, rtol=0)


def hf_float32_scaled_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """transformers' GemmaRMSNorm (offset 1) and Olmo2RMSNorm (offset 0)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.float())).to(x.dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize(("rows", "n"), [(1, 640), (7, 60), (16, 256), (300, 100)])
def test_rms_norm_scaled_in_float32_and_fused_residual(dtype: torch.dtype, offset: float, rows: int, n: int) -> None:
    x, residual, weight = data((rows, n), dtype, 1), data((rows, n), dtype, 2), data((n,), dtype, 3) / 3
    expected = hf_float32_scaled_norm(x, weight, 1e-6, offset)
    torch.testing.assert_close(ops.rms_norm_scaled_in_float32(x, weight, 1e-6, None, offset), expected,
                               **TOLERANCE[dtype])
    torch.testing.assert_close(ops.rms_norm_scaled_in_float32_reference(x, weight, 1e-6, None, offset), expected,
                               atol=0, rtol=0)
    ours_residual, ref_residual = residual.clone(), residual.clone()
    ours = ops.rms_norm_scaled_in_float32(x, weight, 1e-6, ours_residual, offset)
    assert torch.equal(ours_residual, residual + x)  # one rounded add: exact
    torch.testing.assert_close(ours, ops.rms_norm_scaled_in_float32_reference(x, weight, 1e-6, ref_residual, offset),
                               **TOLERANCE[dtype])
    if dtype == torch.bfloat16:
        # One rounding, not Llama's two: most values are the reference's bits, and those
        # that are not sit one bf16 step away (float32 sums tipping a rounding).
        expected = hf_float32_scaled_norm(residual + x, weight, 1e-6, offset)
        steps = (ours.float() - expected.float()).abs() / expected.float().abs().clamp_min(1e-30)
        assert (ours == expected).float().mean() > 0.97 and steps.max() <= 2 ** -7


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n"), [(1, 2048), (5, 17), (16, 1536), (70, 1024)])
def test_gelu_tanh_and_mul(dtype: torch.dtype, rows: int, n: int) -> None:
    gate_up = data((rows, 2 * n), dtype, 4)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 30.0, -30.0, 1e-20, -1e-20, 3e38, -3e38], dtype=dtype)[:min(8, n)]
    expected = F.gelu(gate_up[:, :n], approximate="tanh") * gate_up[:, n:]
    ours = ops.gelu_tanh_and_mul(gate_up)
    torch.testing.assert_close(ours, expected, **TOLERANCE[dtype])
    assert torch.equal(torch.signbit(ours[expected == 0]), torch.signbit(expected[expected == 0]))
    torch.testing.assert_close(ops.gelu_tanh_and_mul_reference(gate_up), expected, atol=0, rtol=0)
    if dtype == torch.bfloat16:
        # The same two roundings, of a GELU computed in float32: most bits are those of the
        # float64 formula rounded the same way, more of them than torch's own kernel gets
        # (93% on these values: its float32 tanh is the less exact).
        x, up = gate_up[:, :n].double(), gate_up[:, n:].double()
        exact = (0.5 * x * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))).to(dtype)
        exact = (exact.double() * up).to(dtype)
        assert (ours == exact).float().mean() > 0.97
        assert (ours == exact).float().mean() >= (expected == exact).float().mean()


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n"), [(1, 640), (7, 60), (16, 256), (300, 100)])
def test_layer_norm_and_fused_residual(dtype: torch.dtype, rows: int, n: int) -> None:
    x, residual = data((rows, n), dtype, 1) + 2, data((rows, n), dtype, 2)  # rows off zero mean
    weight, bias = data((n,), dtype, 3) / 3, data((n,), dtype, 4)
    expected = F.layer_norm(x, (n,), weight, bias, 1e-5)
    ours = ops.layer_norm(x, weight, bias, 1e-5)
    torch.testing.assert_close(ours, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(ops.layer_norm_reference(x, weight, bias, 1e-5), expected, atol=0, rtol=0)
    ours_residual = residual.clone()
    with_residual = ops.layer_norm(x, weight, bias, 1e-5, ours_residual)
    assert torch.equal(ours_residual, residual + x)  # one rounded add: exact
    torch.testing.assert_close(with_residual, F.layer_norm(residual + x, (n,), weight, bias, 1e-5),
                               **TOLERANCE[dtype])
    if dtype == torch.bfloat16:  # one rounding of a float32 value, as torch's: mostly the same bits
        assert (ours == expected).float().mean() > 0.97


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n"), [(1, 2048), (5, 17), (70, 1024)])
def test_gelu_tanh(dtype: torch.dtype, rows: int, n: int) -> None:
    x = data((rows, n), dtype, 5)
    x[0, :8] = torch.tensor([0.0, -0.0, 30.0, -30.0, 1e-20, -1e-20, 3e38, -3e38], dtype=dtype)[:min(8, n)]
    expected = F.gelu(x, approximate="tanh")
    ours = ops.plain_activation(x, "gelu_tanh")
    torch.testing.assert_close(ours, expected, **TOLERANCE[dtype])
    assert torch.equal(torch.signbit(ours[expected == 0]), torch.signbit(expected[expected == 0]))
    exact_form = cpu_ops.gelu_erf(x)  # erf's: GPT-NeoX's (models in bf16; float32 runs take torch's)
    v = x.double()
    formula = 0.5 * v * (1 + torch.erf(v / 2 ** 0.5))  # float64: no overflow below float32's largest
    torch.testing.assert_close(exact_form, formula.to(dtype), **TOLERANCE[dtype])
    # torch's AVX-512 kernel forms x (1 + erf) before halving it, so it overflows to inf from
    # x ~ 1.7e38 (3e38 here); ours stays x there. Held to torch wherever torch is finite.
    finite = F.gelu(x).isfinite()
    torch.testing.assert_close(exact_form[finite], F.gelu(x)[finite], **TOLERANCE[dtype])
    assert exact_form[0, 6] == x[0, 6]  # 3e38: gelu is x that far out
    assert torch.equal(ops.plain_activation(x, "gelu_erf"), exact_form if dtype == torch.bfloat16 else F.gelu(x))
    assert torch.equal(torch.signbit(exact_form[x == 0]), torch.signbit(x[x == 0]))
    if dtype == torch.bfloat16:  # as the tanh form below: nearer the float64 formula's bits than torch's
        exact = formula.to(dtype)
        assert (exact_form == exact).float().mean() > 0.95
        assert (exact_form == exact).float().mean() >= (F.gelu(x) == exact).float().mean()
    if dtype == torch.bfloat16:  # closer to the float64 formula's bits than torch's float32 tanh
        exact = (0.5 * v * (1 + torch.tanh(0.7978845608028654 * (v + 0.044715 * v ** 3)))).to(dtype)
        assert (ours == exact).float().mean() > 0.97
        assert (ours == exact).float().mean() >= (expected == exact).float().mean()


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n"), [(1, 2048), (5, 17), (70, 1024)])
def test_relu_and_its_square_are_torchs_bit_for_bit(dtype: torch.dtype, rows: int, n: int) -> None:
    """OPT's MLP (and Nemotron's square of it): -0 and NaN pass as torch's relu passes them
    (NaN's payload aside)."""
    x = data((rows, n), dtype, 7)
    x[0, :6] = torch.tensor([0.0, -0.0, float("nan"), -float("inf"), float("inf"), -1e-30], dtype=dtype)[:min(6, n)]
    ours, expected = ops.plain_activation(x, "relu"), torch.relu(x)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    number = ~expected.isnan()
    assert torch.equal(ours.isnan(), ~number)
    assert torch.equal(ours.view(bits)[number], expected.view(bits)[number])
    assert 0.3 < (ours == 0).float().mean() < 0.7  # about half the values were negative
    squared = ops.plain_activation(x, "relu2")  # Nemotron's and Arcee's: torch.square(relu(x)), one rounding
    expected = torch.square(torch.relu(x))
    assert torch.equal(squared.isnan(), expected.isnan())
    assert torch.equal(squared.view(bits)[~expected.isnan()], expected.view(bits)[~expected.isnan()])


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_clamp_is_torchs_bit_for_bit(dtype: torch.dtype) -> None:
    """OLMo 1's clip in the native walk (the modules call torch's clamp_)."""
    x = data((7, 300), dtype, 6)
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=dtype)
    ours, expected = x.clone(), x.clone()
    cpu_ops.clamp_(ours, 0.3)  # a bound bf16 rounds
    expected.clamp_(-0.3, 0.3)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    number = ~expected.isnan()  # NaN stays NaN (torch's vector path writes its own payload)
    assert torch.equal(ours.isnan(), ~number)
    assert torch.equal(ours.view(bits)[number], expected.view(bits)[number])
    assert ((ours == 0.3) | (ours == -0.3)).float().mean() > 0.5  # most values were clamped


def hf_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype).unsqueeze(1) + rotated * sin.to(x.dtype).unsqueeze(1)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "head_dim"),
                         [(1, 9, 3, 64), (16, 9, 3, 64), (13, 4, 2, 16), (40, 8, 1, 128),
                          (5, 3, 1, 24)])  # 24: a tail past 8 lanes
def test_rotary_rotates_q_and_k_in_place(dtype: torch.dtype, tokens: int, heads: int, kv_heads: int,
                                         head_dim: int) -> None:
    from kvloom.models.layers import RotaryEmbedding
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None)
    cos, sin = rope.cos_sin(torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(5)))
    qkv = data((tokens, (heads + 2 * kv_heads) * head_dim), dtype, 6)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    expected_q = hf_rotary(q.unflatten(-1, (heads, head_dim)), cos, sin)
    expected_k = hf_rotary(k.unflatten(-1, (kv_heads, head_dim)), cos, sin)
    v_before = v.clone()
    for rotate in (ops.rotary_, ops.rotary_reference_):
        out = qkv.clone()
        rotate(out, heads + kv_heads, head_dim, cos, sin)
        q2, k2, v2 = out.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        torch.testing.assert_close(q2.unflatten(-1, (heads, head_dim)), expected_q, **TOLERANCE[dtype])
        torch.testing.assert_close(k2.unflatten(-1, (kv_heads, head_dim)), expected_k, **TOLERANCE[dtype])
        assert torch.equal(v2, v_before)  # v is never touched


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(128, 96), (32, 24), (64, 32), (24, 8)])
def test_a_partial_rotary_turns_the_first_dims_of_each_head_as_transformers(dtype: torch.dtype, head_dim: int,
                                                                             rotary_dim: int) -> None:
    """Phi-4's (and Bamba's) partial rotary: the native kernel and the reference turn each
    head's first rotary_dim dimensions as transformers does (its q_rot / q_pass split) and
    leave the rest; in bf16 bit for bit each other (each product rounded, as in float32,
    where the compiler may fuse the kernel's multiply and add)."""
    from kvloom.models.layers import RotaryEmbedding
    tokens, heads, kv_heads = 11, 6, 2
    rope = RotaryEmbedding(rotary_dim, 512, 10000.0, None)
    cos, sin = rope.cos_sin(torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(8)))
    qkv = data((tokens, (heads + 2 * kv_heads) * head_dim), dtype, 9)
    qk = qkv[:, :(heads + kv_heads) * head_dim].unflatten(-1, (heads + kv_heads, head_dim))
    expected = torch.cat((hf_rotary(qk[..., :rotary_dim], cos, sin), qk[..., rotary_dim:]), dim=-1)
    native, reference = qkv.clone(), qkv.clone()
    ops.rotary_(native, heads + kv_heads, head_dim, cos, sin)
    ops.rotary_reference_(reference, heads + kv_heads, head_dim, cos, sin)
    assert torch.equal(native, reference) or dtype == torch.float32
    for out in (native, reference):
        rotated = out[:, :(heads + kv_heads) * head_dim].unflatten(-1, (heads + kv_heads, head_dim))
        torch.testing.assert_close(rotated, expected, **TOLERANCE[dtype])
    assert torch.equal(native[:, (heads + kv_heads) * head_dim:], qkv[:, (heads + kv_heads) * head_dim:])


def test_non_cpu_or_odd_dtype_uses_the_reference() -> None:
    x = data((3, 8), torch.float64, 7)
    weight = torch.ones(8, dtype=torch.float64)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), hf_rms_norm(x, weight, 1e-6))
