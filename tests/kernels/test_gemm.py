"""The batch-invariant GEMM (kernels/gemm.py): every path this CPU runs equals the
float32 reference to bf16 rounding, and row i of a call over M rows is bit-identical to
row i computed alone, for M in 1..300, whatever the threads; the dispatch picks the
path the CPU's flags name, and bad calls raise errors that say what is wrong."""

from __future__ import annotations

import pytest
import torch
from helpers_cpu import cpu_flags

from kvloom.kernels import gemm

ISAS_HERE = gemm.supported_isas()  # AMX only where the CPU has it; lower paths everywhere


def expected_best_isa(flags: set[str]) -> str | None:
    if {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else None


def random_problem(m: int, n: int, k: int, bias: bool, seed: int):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=generator) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=generator).bfloat16() if bias else None
    x = torch.randn(m, k, generator=generator).bfloat16()
    return x, weight, b


def test_dispatch_matches_the_cpu_flags() -> None:
    assert ISAS_HERE, "the GEMM must build and run on every machine we test on"
    best = expected_best_isa(cpu_flags())
    assert ISAS_HERE[-1] == best
    assert ISAS_HERE == gemm.ISAS[:gemm.ISAS.index(best) + 1]  # every lower path runs too


@pytest.mark.parametrize("isa", ISAS_HERE)
@pytest.mark.parametrize(("m", "n", "k", "bias"), [
    (1, 1, 1, False), (3, 17, 33, True), (50, 100, 63, False), (7, 37, 5, True),
    (40, 960, 576, False), (19, 576, 1536, False), (33, 130, 64, True), (6, 64, 2, False),
    # More rows than one pass over the weight keeps in L2 (64 at k=1536, 128 at k=1000):
    (150, 70, 1536, True), (300, 40, 1000, False),
])
def test_equals_the_float32_reference(isa: str, m: int, n: int, k: int, bias: bool) -> None:
    x, weight, b = random_problem(m, n, k, bias, seed=m * 7 + n)
    got = gemm.gemm_bf16(x, gemm.pack_weight(weight), b, n, isa).float()
    want = gemm.gemm_reference(x, weight, b).float()
    # Both sum the exact products in float32 (in different orders) and round once.
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("isa", ISAS_HERE)
@pytest.mark.parametrize(("n", "k"), [(100, 96), (50, 37), (40, 1536)])  # the last: 5 passes of rows
def test_rows_are_bit_identical_alone_and_in_any_batch(isa: str, n: int, k: int) -> None:
    x, weight, b = random_problem(300, n, k, bias=True, seed=n + k)
    packed = gemm.pack_weight(weight)
    alone = torch.cat([gemm.gemm_bf16(x[i:i + 1], packed, b, n, isa) for i in range(300)])
    for m in range(1, 301):
        assert torch.equal(gemm.gemm_bf16(x[:m], packed, b, n, isa), alone[:m]), f"M={m}"
    order = torch.randperm(300, generator=torch.Generator().manual_seed(1))
    assert torch.equal(gemm.gemm_bf16(x[order].contiguous(), packed, b, n, isa), alone[order])
    threads = torch.get_num_threads()
    try:
        # One thread; and more threads than cores, whose shares of the weight are cut
        # short by the OS, so that threads take units from each other (work_shares.h).
        for count in (1, 5):
            torch.set_num_threads(count)
            assert torch.equal(gemm.gemm_bf16(x, packed, b, n, isa), alone), f"{count} threads"
    finally:
        torch.set_num_threads(threads)


def bf16_bits_rounded(values: torch.Tensor) -> torch.Tensor:
    """float32 -> the bf16 bit patterns store_row's rule gives (nearest, ties to even on
    the bits; NaN -> 0x7fc0), as int32, computed here on the integers."""
    bits = values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return torch.where(values.isnan(), torch.full_like(rounded, 0x7FC0), rounded).to(torch.int32)


@pytest.mark.parametrize("isa", ISAS_HERE)
@pytest.mark.parametrize("bias", [False, True])
def test_every_path_rounds_its_sums_by_one_rule(isa: str, bias: bool) -> None:
    # K = 2 with the second pair zero: each output is one exact product a * b (+ bias, one
    # float32 add), the same float32 on every path, so the bits out are the store's
    # rounding alone (one vcvtneps2bf16 on AVX512-BF16 and AMX, the bit rule elsewhere).
    # A 16-bit product rounded to 8 bits meets ties to even, and the operands below also
    # overflow to +-inf and carry NaN through.
    generator = torch.Generator().manual_seed(5)
    a = torch.randn(64, generator=generator) * 2.0 ** torch.randint(-20, 20, (64,), generator=generator)
    b = torch.randn(48, generator=generator) * 2.0 ** torch.randint(-20, 20, (48,), generator=generator)
    a[:4] = torch.tensor([3e38, -2e38, float("nan"), 0.0])
    b[:3] = torch.tensor([2.0, 3.0, -0.0])
    x = torch.stack([a, torch.zeros_like(a)], 1).bfloat16()
    weight = torch.stack([b, torch.zeros_like(b)], 1).bfloat16()
    bias_values = (torch.randn(48, generator=generator) * 4).bfloat16() if bias else None
    # bf16 x bf16 is exact in float32; every path adds it to an accumulator that starts
    # at +0 (so a -0 product sums to +0).
    exact = x[:, :1].float() * weight[:, 0].float() + 0.0
    if bias_values is not None:
        exact = exact + bias_values.float()
    got = gemm.gemm_bf16(x, gemm.pack_weight(weight), bias_values, 48, isa)
    assert torch.equal(got.view(torch.int16).to(torch.int32) & 0xFFFF, bf16_bits_rounded(exact))


@pytest.mark.parametrize("isa", ISAS_HERE)
def test_an_empty_k_gives_each_output_its_bias(isa: str) -> None:
    # K = 0: every sum is empty, so an output is its accumulator's +0 plus its bias, as
    # for a row of zeros at any K (a -0 bias gives +0, where F.linear copies the -0; a NaN
    # stays NaN). It used to stop the process (SIGFPE: the paths pace their fetches by
    # K's steps).
    x = torch.empty(3, 0, dtype=torch.bfloat16)
    weight = torch.empty(40, 0, dtype=torch.bfloat16)
    b = torch.randn(40, generator=torch.Generator().manual_seed(3)).bfloat16()
    b[:2] = torch.tensor([-0.0, float("nan")])
    packed = gemm.pack_weight(weight)
    assert torch.equal(gemm.gemm_bf16(x, packed, None, 40, isa), torch.zeros(3, 40, dtype=torch.bfloat16))
    got = gemm.gemm_bf16(x, packed, b, 40, isa)
    want = (torch.nn.functional.linear(x.float(), weight.float(), b.float()) + 0.0).bfloat16()
    assert torch.equal(got.isnan(), want.isnan()) and want[:, 1].isnan().all()
    assert torch.equal(got.nan_to_num().view(torch.int16), want.nan_to_num().view(torch.int16))


def test_model_shapes_are_row_invariant_on_the_default_path() -> None:
    isa = gemm.default_isa()
    for n, k in [(960, 576), (3072, 576), (576, 1536)]:  # SmolLM2's qkv, gate/up, down
        x, weight, _ = random_problem(257, n, k, bias=False, seed=n)
        packed = gemm.pack_weight(weight)
        alone = torch.cat([gemm.gemm_bf16(x[i:i + 1], packed, None, n, isa) for i in (0, 100, 256)])
        together = gemm.gemm_bf16(x, packed, None, n, isa)[[0, 100, 256]]
        assert torch.equal(together, alone)


def test_bad_calls_raise_clear_errors() -> None:
    x, weight, b = random_problem(4, 20, 8, bias=True, seed=0)
    packed = gemm.pack_weight(weight)
    isa = ISAS_HERE[0]
    with pytest.raises(ValueError, match="x must be a contiguous 2-D bf16"):
        gemm.gemm_bf16(x.float(), packed, b, 20, isa)
    with pytest.raises(ValueError, match="x must be a contiguous 2-D bf16"):
        gemm.gemm_bf16(x.t(), packed, b, 20, isa)
    with pytest.raises(ValueError, match="packed has .* elements"):
        gemm.gemm_bf16(x, packed, b, 40, isa)
    with pytest.raises(ValueError, match="bias must be a contiguous \\[20\\] bf16"):
        gemm.gemm_bf16(x, packed, b[:10], 20, isa)
    with pytest.raises(ValueError, match="isa must be one of"):
        gemm.gemm_bf16(x, packed, b, 20, "sse2")
    if "amx" not in ISAS_HERE:
        with pytest.raises(RuntimeError, match="does not run the 'amx' path"):
            gemm.gemm_bf16(x, packed, b, 20, "amx")
    with pytest.raises(ValueError, match="2-D bf16 CPU tensor"):
        gemm.pack_weight(weight.float())


def test_fake_tensors_get_the_output_shape() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    packed_elements = gemm.pack_weight(torch.zeros(20, 8, dtype=torch.bfloat16)).numel()
    with FakeTensorMode():
        x = torch.empty(5, 8, dtype=torch.bfloat16)
        packed = torch.empty(packed_elements, dtype=torch.bfloat16)
        assert gemm.gemm_bf16(x, packed, None, 20, ISAS_HERE[0]).shape == (5, 20)


def test_environment_caps_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    gemm.default_isa.cache_clear()
    try:
        monkeypatch.setenv(gemm.ISA_ENV, "avx2")
        assert gemm.default_isa() == "avx2"
        gemm.default_isa.cache_clear()
        monkeypatch.setenv(gemm.ISA_ENV, "amx")  # a cap above the CPU's best is the best
        assert gemm.default_isa() == ISAS_HERE[-1]
        gemm.default_isa.cache_clear()
        monkeypatch.setenv(gemm.ISA_ENV, "neon")
        with pytest.raises(ValueError, match="KVLOOM_CPU_ISA must be one of"):
            gemm.default_isa()
    finally:
        monkeypatch.delenv(gemm.ISA_ENV)
        gemm.default_isa.cache_clear()


def test_a_crashing_or_wrong_amx_build_is_left_out(monkeypatch, tmp_path) -> None:
    """The AMX path is first run in a child process; a crash (SIGILL, SIGSEGV) or a
    mismatch there keeps it out, and the verdict is remembered beside the build."""
    assert gemm.probe_verdict("import sys; sys.exit(0)") == "ok"
    assert gemm.probe_verdict("import sys; sys.exit(3)") == "its results disagree with AVX512-BF16"
    crashed = gemm.probe_verdict("import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    assert crashed.startswith("the probe process ended with status -4")
    monkeypatch.setenv("KVLOOM_HOME", str(tmp_path))
    probes = []
    monkeypatch.setattr(gemm, "probe_verdict", lambda code: probes.append(code) or crashed)
    assert gemm.amx_verified() is False and gemm.amx_verified() is False
    assert len(probes) == 1  # the second answer came from the verdict file
    assert list((tmp_path / "kernels").glob("gemm-*.amx"))


def test_weights_packed_together_equal_each_packed_alone() -> None:
    generator = torch.Generator().manual_seed(5)
    shapes = [(960, 576), (17, 33), (3072, 576), (1, 1), (576, 1536)]
    weights = [torch.randn(n, k, generator=generator).bfloat16() for n, k in shapes]
    views = gemm.pack_weights(weights)
    assert [v.numel() for v in views] == [gemm.packed_elements(n, k) for n, k in shapes]
    for weight, view in zip(weights, views, strict=True):
        assert torch.equal(view, gemm.pack_weight(weight))  # the same bytes, padding zero too
    # One buffer, in the order given, each view at a cache-line boundary.
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    starts = [v.data_ptr() for v in views]
    assert starts == sorted(starts) and all(s % 64 == 0 for s in starts)
    assert all(a.data_ptr() + 2 * a.numel() <= b.data_ptr() for a, b in zip(views, views[1:], strict=False))
    x = torch.randn(5, 576, generator=generator).bfloat16()
    torch.testing.assert_close(gemm.gemm_bf16(x, views[2], None, 3072, gemm.default_isa()).float(),
                               gemm.gemm_reference(x, weights[2], None).float(), rtol=1.6e-2, atol=1e-2)
    with pytest.raises(ValueError, match="2-D bf16 CPU tensor"):
        gemm.pack_weights([weights[0], weights[1].float()])


def side_stream(lines: int, span_lines: int = 96) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """csrc/side_stream.h's SideStream over `lines` lines: spans of a buffer, out of order,
    with the extra entry; returns (the struct as int64 words, the spans, the buffer)."""
    count = max(1, -(-lines // span_lines))
    buffer = torch.zeros(count * span_lines * 64 + 64, dtype=torch.uint8)
    order = torch.randperm(count, generator=torch.Generator().manual_seed(lines))
    spans = torch.tensor([buffer.data_ptr() + int(i) * span_lines * 64 for i in order] + [buffer.data_ptr()],
                         dtype=torch.int64)
    return torch.tensor([spans.data_ptr(), span_lines, 0, lines], dtype=torch.int64), spans, buffer


@pytest.mark.parametrize("isa", ISAS_HERE)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 960, 576), (16, 3072, 576), (33, 576, 1536), (70, 100, 63),
                                           (5, 17, 33)])
@pytest.mark.parametrize("lines", [1, 97, 5000, 400_000])  # one; a span and one; ~steps; far more than 2 a step
def test_a_side_stream_changes_no_bit(isa: str, m: int, n: int, k: int, lines: int) -> None:
    # On AVX512-BF16 the tiles that also fetch a side stream run their k steps in three
    # stretches of their own (csrc/gemm.cpp for_each_pair_side): a step skipped or
    # repeated there would change the sums. The AMX tiles fetch theirs between their K
    # chunks (run here on emulated tiles where the CPU lacks AMX); the other paths take
    # the plain call.
    x, weight, b = random_problem(m, n, k, bias=True, seed=m + n + k)
    packed = gemm.pack_weight(weight)
    want = gemm.gemm_bf16(x, packed, b, n, isa)
    side, _spans, _buffer = side_stream(lines)
    for threads in (1, 2):
        got = torch.empty(m, n, dtype=torch.bfloat16)
        status = gemm.GEMM_SIDE.function()(x.data_ptr(), packed.data_ptr(), b.data_ptr(), got.data_ptr(), m, n, k,
                                           gemm.isa_code(isa), threads, side.data_ptr())
        assert status == 0
        assert torch.equal(got, want), f"{isa}, {threads} thread(s): the side stream changed the result"


@pytest.mark.parametrize("isa", ISAS_HERE)
@pytest.mark.parametrize(("counts", "n", "k"), [
    ([1, 0, 2, 1], 192, 576),            # decode: a few rows an expert, one expert unused
    ([0, 37, 0, 0, 5, 300], 100, 63),    # tails in n and k; an expert with several passes of rows
    ([3] * 40, 48, 96),                  # many experts of a few rows (threads share them out)
    ([0, 0, 0], 40, 32),                 # no rows at all
])
def test_a_grouped_call_is_each_groups_own_call(isa: str, counts: list[int], n: int, k: int) -> None:
    """Every group's rows get the bits of one kvloom_gemm_bf16 call with its weight (and so
    the float32 reference's, to rounding), whichever groups share the grouped call."""
    generator = torch.Generator().manual_seed(len(counts) + n)
    weights = [(torch.randn(n, k, generator=generator) / k ** 0.5).bfloat16() for _ in counts]
    packed, = gemm.pack_weight_groups([weights])
    x = torch.randn(sum(counts), k, generator=generator).bfloat16()
    starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    y = gemm.gemm_grouped_bf16(x, packed, starts, n, isa)
    assert y.shape == (sum(counts), n)
    for group, weight in enumerate(weights):
        rows = x[starts[group]:starts[group + 1]]
        if rows.shape[0]:
            alone = gemm.gemm_bf16(rows.contiguous(), gemm.pack_weight(weight), None, n, isa)
            assert torch.equal(y[starts[group]:starts[group + 1]], alone), f"group {group}"
            reference = gemm.gemm_reference(rows, weight, None).float()
            assert (y[starts[group]:starts[group + 1]].float() - reference).abs().max() <= 0.02 * reference.abs().max()


def test_grouped_weights_are_stacked_views_of_one_buffer() -> None:
    gate_ups = [torch.randn(32, 16).bfloat16() for _ in range(3)]
    downs = [torch.randn(16, 16).bfloat16() for _ in range(3)]
    first, second = gemm.pack_weight_groups([gate_ups, downs])
    assert first.shape == (3, gemm.packed_elements(32, 16)) and second.shape == (3, gemm.packed_elements(16, 16))
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert second.data_ptr() == first.data_ptr() + 2 * first.numel()  # the second group after the first
    for weight, row in zip(gate_ups + downs, list(first) + list(second), strict=True):
        assert torch.equal(row, gemm.pack_weight(weight))
    with pytest.raises(ValueError, match="must share one shape"):
        gemm.pack_weight_groups([[torch.zeros(32, 16).bfloat16(), torch.zeros(16, 16).bfloat16()]])
