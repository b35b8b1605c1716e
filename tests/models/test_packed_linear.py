"""Packed linear layers: oneDNN's equal F.linear bit for bit where the CPU has native
bf16, to one rounding where oneDNN emulates it (and an engine on them generates exactly
what one on F.linear does); the invariant one equals the float32
reference; float32 rows do not depend on the call; the matmul choice swaps exactly the
layers it can serve."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers_cpu import has_native_bf16
from helpers_models import write_tiny_hf_model
from torch import nn

from kvloom import LLM, SamplingParams
from kvloom.kernels import gemm
from kvloom.models.packed_linear import (
    Float32Linear,
    InvariantLinear,
    PackedLinear,
    can_pack,
    float32_rows,
    pack_linear_layers,
)

needs_bf16 = pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)),
                                reason="oneDNN bf16 matmul not supported by this CPU")


@needs_bf16
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize(("in_features", "out_features", "bias"),
                         [(64, 96, False), (576, 3072, False), (1536, 576, False), (48, 80, True)])
def test_packed_equals_f_linear_bitwise(rows: int, in_features: int, out_features: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    b = torch.randn(out_features, generator=generator).bfloat16() if bias else None
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    packed, plain = PackedLinear(weight, b)(x), F.linear(x, weight, b)
    if has_native_bf16():
        assert torch.equal(packed, plain)
    else:  # oneDNN's float32 emulation picks another kernel for some prepacked shapes
        torch.testing.assert_close(packed.float(), plain.float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize(("in_features", "out_features", "bias"), [(64, 96, False), (48, 80, True)])
def test_invariant_linear_equals_the_reference(in_features: int, out_features: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    b = torch.randn(out_features, generator=generator).bfloat16() if bias else None
    x = torch.randn(2, 3, in_features, generator=generator).bfloat16()  # leading dims kept
    got = InvariantLinear(weight, b)(x)
    assert got.shape == (2, 3, out_features)
    want = gemm.gemm_reference(x.reshape(6, in_features), weight, b).view(2, 3, out_features)
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize(("matmul", "layer"), [("invariant", InvariantLinear), ("onednn", PackedLinear)])
def test_only_cpu_bf16_is_packed(matmul: str, layer: type) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4)))
    if matmul == "invariant":  # float32: F.linear with its rows padded
        assert pack_linear_layers(model, matmul) == 2
        assert all(isinstance(m, Float32Linear) for m in (model[0], model[1][0]))
        model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4)))
    else:
        assert pack_linear_layers(model, matmul) == 0  # float32 stays on F.linear
        assert all(isinstance(m, nn.Linear) for m in (model[0], model[1][0]))
    model = model.bfloat16()
    if matmul == "onednn" and not can_pack(model[0].weight):
        return
    assert pack_linear_layers(model, matmul) == 2
    assert isinstance(model[1][0], layer)
    assert pack_linear_layers(nn.Sequential(nn.Linear(8, 8)).bfloat16(), "torch") == 0
    with pytest.raises(ValueError, match="matmul must be one of"):
        pack_linear_layers(nn.Sequential(nn.Linear(8, 8)), "mkl")


@pytest.mark.parametrize(("in_features", "out_features", "bias"),
                         [(64, 192, False), (576, 1536, True), (100, 37, True)])
def test_float32_linear_rows_do_not_depend_on_the_call(in_features: int, out_features: int, bias: bool) -> None:
    """Every row count from 1 to 40, at three offsets, against the rows of one 300-row
    F.linear call (MKL's large-M kernel), bit for bit; and the values against a float64
    product. Plain F.linear fails this on AMD EPYC Milan (1-11 rows not a multiple of 4),
    where the probe turns padding on."""
    generator = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    x = torch.randn(300, in_features, generator=generator)
    whole = F.linear(x, weight, b)
    want = x.double() @ weight.double().T + (0 if b is None else b.double())
    torch.testing.assert_close(whole.double(), want, rtol=1e-5, atol=1e-4)
    # The probe's choice, and padding always: both must hold (padding is on where the
    # probe finds plain F.linear fails this; elsewhere it must not change a bit).
    for layer in (Float32Linear(weight, b), Float32Linear(weight, b, pad=True)):
        for rows in range(1, 41):
            for start in (0, 7, 300 - rows):
                got = layer(x[start:start + rows].view(1, rows, in_features))  # leading dims kept
                assert got.shape == (1, rows, out_features)
                assert torch.equal(got[0], whole[start:start + rows]), (layer.pad, rows, start)
    assert [float32_rows(m) for m in (0, 1, 3, 4, 5, 9, 11, 12, 13)] == [0, 4, 4, 4, 8, 12, 12, 12, 13]


@needs_bf16
@pytest.mark.parametrize("tied", [False, True])
def test_engine_outputs_identical_with_and_without_onednn_packing(tmp_path, tied: bool) -> None:
    path = write_tiny_hf_model(tmp_path / "m", arch="llama", tie_word_embeddings=tied)
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(5 + 9 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = LLM(str(path), dtype="bfloat16", num_blocks=64, matmul="torch")
    packed = LLM(str(path), dtype="bfloat16", num_blocks=64, matmul="onednn")
    assert not any(isinstance(m, PackedLinear) for m in plain.engine.model.modules())
    # every projection of every layer plus the output head (its own copy when tied)
    num_layers = packed.engine.model_config.num_layers
    assert sum(isinstance(m, PackedLinear) for m in packed.engine.model.modules()) == 4 * num_layers + 1
    for a, b in zip(plain.generate(prompts, params), packed.generate(prompts, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
