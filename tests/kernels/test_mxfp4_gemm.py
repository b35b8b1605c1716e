"""The MXFP4 linear kernel (kernels/mxfp4.py, csrc/mxfp4_gemm.cpp): every path this CPU
runs stays within float32 rounding of a float64 product with the dequantized weight; a
row's bits do not depend on the batch or the thread count; the paths give the same bits;
the dispatch follows the CPU and $KVLOOM_CPU_ISA; wrong calls raise naming the argument;
and MXFP4Linear is a Linear over the kernel."""

from __future__ import annotations

import pytest
import torch
from helpers_cpu import cpu_flags

from kvloom.kernels import mxfp4

PATHS = mxfp4.supported_isas()
DTYPES = [torch.bfloat16, torch.float32]
needs_kernel = pytest.mark.skipif(not mxfp4.available(), reason="mxfp4_gemm.cpp does not build here")


def random_pair(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes (both zeros among them) and scales from 2^-10 to 2^4."""
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 16), generator=generator, dtype=torch.uint8)
    blocks[0, :, :2] = 0x80  # +0 and -0 codes
    scales = torch.randint(127 - 10, 127 + 5, (n, k // 32), generator=generator, dtype=torch.uint8)
    scales[-1, 0], scales[0, -1] = 127 - 10, 127 + 4  # the range's ends, in any case
    return blocks, scales


def random_problem(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int):
    blocks, scales = random_pair(n, k, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=generator).to(dtype)
    b = torch.randn(n, generator=generator).to(dtype) if bias else None
    return x, blocks, scales, b


def test_dequantize_follows_the_format() -> None:
    # Byte b of group g of row r: W[r, 32g + 2b] in the low nibble, W[r, 32g + 2b + 1] in
    # the high one; a group times 2^(scale - 127). Written out element by element.
    blocks, scales = random_pair(3, 64, seed=0)
    got = mxfp4.dequantize_mxfp4(blocks, scales, torch.float32)
    want = torch.empty(3, 64, dtype=torch.float64)
    for r in range(3):
        for j in range(64):
            byte = int(blocks[r, j // 32, j % 32 // 2])
            code = byte & 15 if j % 2 == 0 else byte >> 4
            want[r, j] = mxfp4.E2M1_VALUES[code] * 2.0 ** (int(scales[r, j // 32]) - 127)
    assert torch.equal(got.double(), want)
    assert torch.equal(mxfp4.dequantize_mxfp4(blocks, scales), got.bfloat16())  # exact in bf16 too


def within_float32_rounding(got: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                            bias: torch.Tensor | None) -> None:
    """|got - exact| within the float32 sum's error bound (each output: 2 adds a group in
    its lane, 4 for the lanes' sum, 1 for the bias) plus the final rounding to got's dtype."""
    weight = mxfp4.dequantize_mxfp4(blocks, scales, torch.float32).double()
    exact = x.double() @ weight.T
    magnitude = x.double().abs() @ weight.abs().T
    if bias is not None:
        exact, magnitude = exact + bias.double(), magnitude + bias.double().abs()
    adds = 2 * blocks.shape[1] + 5
    output_rounding = 2.0 ** -8 if got.dtype == torch.bfloat16 else 2.0 ** -24
    bound = 1.01 * (adds * 2.0 ** -24 * magnitude * (1 + output_rounding) + output_rounding * exact.abs())
    error = (got.double() - exact).abs()
    assert (error <= bound + 1e-30).all(), f"worst excess {(error - bound).max().item():.3g}"


@needs_kernel
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "float32"])
@pytest.mark.parametrize(("m", "n", "k", "bias"), [
    (1, 70, 32, False), (1, 70, 288, True), (3, 70, 96, True), (16, 70, 288, False), (37, 70, 288, True),
    (5, 1, 32, True), (16, 70, 2880, True),
])
def test_equals_the_float64_reference_to_float32_rounding(isa: str, dtype: torch.dtype, m: int, n: int, k: int,
                                                          bias: bool) -> None:
    x, blocks, scales, b = random_problem(m, n, k, dtype, bias, seed=m * 7 + n + k)
    got = mxfp4.mxfp4_linear(x, blocks, scales, b, isa)
    assert got.dtype == dtype and got.shape == (m, n)
    within_float32_rounding(got, x, blocks, scales, b)
    if dtype == torch.bfloat16:  # then at most an ulp from the float64 product's rounding
        reference = mxfp4.mxfp4_linear_reference(x, blocks, scales, b)
        torch.testing.assert_close(got, reference, rtol=2.0 ** -7, atol=0.0)


@needs_kernel
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "float32"])
@pytest.mark.parametrize(("n", "k", "rows"), [(70, 288, 37), (40, 2880, 50)])  # the last: passes of 40 / 16 rows
def test_rows_are_bit_identical_alone_and_in_any_batch(isa: str, dtype: torch.dtype, n: int, k: int,
                                                       rows: int) -> None:
    x, blocks, scales, b = random_problem(rows, n, k, dtype, bias=True, seed=n + k)
    alone = torch.cat([mxfp4.mxfp4_linear(x[i:i + 1], blocks, scales, b, isa) for i in range(rows)])
    for m in range(1, rows + 1):
        assert torch.equal(mxfp4.mxfp4_linear(x[:m], blocks, scales, b, isa), alone[:m]), f"M={m}"
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(1))
    assert torch.equal(mxfp4.mxfp4_linear(x[order].contiguous(), blocks, scales, b, isa), alone[order])
    threads = torch.get_num_threads()
    try:
        # One thread, two, and more threads than cores (their shares cut short by the OS,
        # so that threads take tiles from each other: work_shares.h).
        for count in (1, 2, 5):
            torch.set_num_threads(count)
            assert torch.equal(mxfp4.mxfp4_linear(x, blocks, scales, b, isa), alone), f"{count} threads"
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "float32"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 70, 288), (6, 70, 96), (37, 33, 288)])
def test_every_path_gives_the_same_bits(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    # The same operations in the same order on every path (for bf16 x, vdpbf16ps's, which
    # the other paths compute as fmas; the data stay clear of the subnormals it flushes).
    x, blocks, scales, b = random_problem(m, n, k, dtype, bias=True, seed=m + n)
    results = {isa: mxfp4.mxfp4_linear(x, blocks, scales, b, isa) for isa in PATHS}
    for isa, y in results.items():
        assert torch.equal(y, results["scalar"]), isa


@needs_kernel
def test_no_rows_and_no_inputs() -> None:
    x, blocks, scales, b = random_problem(0, 70, 64, torch.bfloat16, bias=True, seed=2)
    assert mxfp4.mxfp4_linear(x, blocks, scales, b).shape == (0, 70)
    x = torch.randn(3, 0).bfloat16()
    blocks, scales = torch.empty(70, 0, 16, dtype=torch.uint8), torch.empty(70, 0, dtype=torch.uint8)
    for isa in PATHS:  # empty sums: each output is its bias
        assert torch.equal(mxfp4.mxfp4_linear(x, blocks, scales, b, isa), b.expand(3, 70))


def expected_best(flags: set[str]) -> str:
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "scalar"


@needs_kernel
def test_the_paths_follow_the_cpu_and_kvloom_cpu_isa(monkeypatch: pytest.MonkeyPatch) -> None:
    best = expected_best(cpu_flags())
    assert PATHS == mxfp4.ISAS[:mxfp4.ISAS.index(best) + 1]

    def default_with(cap: str | None) -> str:
        if cap is None:
            monkeypatch.delenv("KVLOOM_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("KVLOOM_CPU_ISA", cap)
        mxfp4.default_isa.cache_clear()  # chosen once per process: asked again here
        return mxfp4.default_isa()

    try:
        assert default_with(None) == best
        assert default_with("avx2") == mxfp4.ISAS[min(mxfp4.ISAS.index(best), mxfp4.ISAS.index("avx2"))]
        assert default_with("amx") == best  # the GEMM's best path caps nothing here
        with pytest.raises(ValueError, match="KVLOOM_CPU_ISA must be one of"):
            default_with("sse2")
    finally:
        monkeypatch.undo()
        mxfp4.default_isa.cache_clear()


@needs_kernel
@pytest.mark.parametrize(("argument", "change", "message"), [
    ("x", lambda a: a.__setitem__(0, a[0].half()), "must be a contiguous 2-D float32 or bf16 CPU tensor"),
    ("x", lambda a: a.__setitem__(0, a[0][:, ::2]), "must be a contiguous"),
    ("x", lambda a: a.__setitem__(0, a[0].to("meta")), "must be a .* CPU tensor, got .* on meta"),
    ("x", lambda a: a.__setitem__(0, a[0][:, :48].contiguous()), "has 48 columns .*multiple of 32"),
    ("blocks", lambda a: a.__setitem__(1, a[1].to(torch.int8)), "must be a contiguous 3-D uint8"),
    ("blocks", lambda a: a.__setitem__(1, a[1][:, :1].contiguous()), r"must be \[n, 2, 16\]"),
    ("blocks", lambda a: a.__setitem__(1, a[1][:, :, :8].contiguous()), r"must be \[n, 2, 16\]"),
    ("scales", lambda a: a.__setitem__(2, a[2][:10].contiguous()), r"must be \[20, 2\]"),
    ("scales", lambda a: a.__setitem__(2, a[2].float()), "must be a contiguous 2-D uint8"),
    ("bias", lambda a: a.__setitem__(3, a[3][:10]), r"must have one value per output, \[20\]"),
    ("bias", lambda a: a.__setitem__(3, a[3].float()), r"must be .*bf16 \(x's dtype\)"),
    ("isa", lambda a: a.__setitem__(4, "sse2"), "must be one of"),
])
def test_wrong_arguments_raise_naming_them(argument: str, change, message: str) -> None:
    x, blocks, scales, b = random_problem(4, 20, 64, torch.bfloat16, bias=True, seed=3)
    args = [x, blocks, scales, b, mxfp4.default_isa()]
    change(args)
    with pytest.raises(ValueError, match=rf"^kvloom::mxfp4_linear: {argument} {message}"):
        mxfp4.mxfp4_linear(*args)


@needs_kernel
def test_mxfp4_linear_is_a_linear_over_the_kernel() -> None:
    x, blocks, scales, b = random_problem(6, 70, 96, torch.bfloat16, bias=True, seed=4)
    layer = mxfp4.MXFP4Linear(blocks, scales, b)
    assert (layer.out_features, layer.in_features) == (70, 96)
    assert layer.blocks.data_ptr() == blocks.data_ptr()  # a view of the owner's codes, no copy
    assert torch.equal(layer(x.view(2, 3, 96)), mxfp4.mxfp4_linear(x, blocks, scales, b).view(2, 3, 70))
    # .to(dtype) converts the bias, never the codes; the module follows x's dtype.
    layer = layer.to(torch.float32)
    assert layer.blocks.dtype == layer.scales.dtype == torch.uint8 and layer.bias is not None
    assert layer.bias.dtype == torch.float32
    assert torch.equal(layer(x.float()), mxfp4.mxfp4_linear(x.float(), blocks, scales, b.float()))
    assert torch.equal(layer(x), mxfp4.mxfp4_linear(x, blocks, scales, b))  # bias cast to bf16 per call
    assert {name for name, _ in layer.named_buffers()} == {"blocks", "scales", "bias"}
    assert layer.state_dict() == {}  # the owner of the codes saves them
    # Where the kernel does not run (here: float16), W dequantized and F.linear.
    half = layer(x.half())
    torch.testing.assert_close(half.float(), mxfp4.mxfp4_linear_reference(x.float(), blocks, scales, b.float()),
                               rtol=1e-2, atol=5e-2)
    with pytest.raises(ValueError, match=r"MXFP4Linear: scales must be \[70, 3\] uint8"):
        mxfp4.MXFP4Linear(blocks, scales[:, :2])
