"""Mamba2's kernels (kvloom/csrc/ssm.cpp) against their pure-PyTorch references. The scan
against models/ssm_ops.sequential_scan, one request at a time: the outputs and the states
left in the slots agree to float32 rounding for a batch of prompt chunks and decodes in any
slots, some from a zero state (their old slot contents unread); slots no request names are
not touched; a request's bits do not depend on the batch; spans and slots outside their
tensors are refused by name. The whole mixer between its projections (``mamba_mixer``)
against the module's reference path (the convolution, the chunked SSD scan and the gated
norm in torch) in float32 and bf16, its states too. The model-level tests (Mamba2, Bamba,
Granite 4.0 against transformers) run them on every step. On an AVX-512 CPU the lower
paths' build (no AVX-512) passes the same tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvloom import native
from kvloom.kernels import ssm
from kvloom.models import ssm_ops

pytestmark = pytest.mark.skipif(not ssm.available(), reason="ssm.cpp does not build here")


def inputs(tokens: int, heads: int, head_dim: int, d_state: int, slots: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"state": torch.randn(slots, heads, head_dim, d_state, generator=g),
            "x": torch.randn(tokens, heads, head_dim, generator=g),
            "dt": torch.nn.functional.softplus(torch.randn(tokens, heads, generator=g)),
            "A": -torch.rand(heads, generator=g) * 4, "B": torch.randn(tokens, heads, d_state, generator=g),
            "C": torch.randn(tokens, heads, d_state, generator=g), "D": torch.randn(heads, generator=g)}


def int64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@pytest.mark.parametrize(("heads", "head_dim", "d_state"), [(2, 4, 8), (18, 64, 64), (3, 16, 100)])
def test_the_kernel_is_the_sequential_reference(heads: int, head_dim: int, d_state: int) -> None:
    # Five requests: a 7-token chunk continuing its state, a fresh 5-token prompt, two
    # decodes (one from a zero state: a 1-token prompt) and an empty span, in mixed slots.
    lengths, slots, has_state = [7, 1, 5, 1, 0], [6, 1, 3, 0, 7], [True, False, False, True, True]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    t = inputs(sum(lengths), heads, head_dim, d_state, slots=8)
    expected_state, expected_y = t["state"].clone(), torch.empty_like(t["x"])
    for start, length, slot, has in zip(starts, lengths, slots, has_state, strict=True):
        if length == 0:
            continue
        span = slice(start, start + length)
        initial = t["state"][slot] if has else torch.zeros_like(t["state"][slot])
        expected_y[span], expected_state[slot] = ssm_ops.sequential_scan(
            t["x"][span], t["dt"][span], t["A"], t["B"][span], t["C"][span], t["D"], initial)
    state = t["state"].clone()
    state[[1, 3]] = float("nan")  # a fresh request's old slot is never read
    y = ssm.ssm_scan_(state, int64(slots), torch.tensor(has_state, dtype=torch.int32), int64(starts), int64(lengths),
                      t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"])
    torch.testing.assert_close(y, expected_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-5)
    untouched = int64([2, 4, 5])
    assert torch.equal(state[untouched], t["state"][untouched])


def test_a_requests_bits_do_not_depend_on_its_batch() -> None:
    lengths = [1, 4, 1, 9, 1, 1]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    t = inputs(sum(lengths), 18, 64, 64, slots=6, seed=1)
    everyone, has_state = int64(list(range(6))), torch.ones(6, dtype=torch.int32)
    together = t["state"].clone()
    y_together = ssm.ssm_scan_(together, everyone, has_state, int64(starts), int64(lengths), t["x"], t["dt"],
                               t["A"], t["B"], t["C"], t["D"])
    for i in range(6):
        span = slice(starts[i], starts[i] + lengths[i])
        alone = t["state"].clone()
        y_alone = ssm.ssm_scan_(alone, everyone[i:i + 1], has_state[i:i + 1], int64([0]), int64([lengths[i]]),
                                t["x"][span], t["dt"][span], t["A"], t["B"][span], t["C"][span], t["D"])
        assert torch.equal(y_alone, y_together[span]) and torch.equal(alone[i], together[i])


@pytest.mark.parametrize(("slots", "starts", "lengths", "message"), [
    ([0, 3], [0, 1], [1, 1], r"slots must lie in \[0, 3\), got \[0, 3\]"),
    ([0, 1], [0, 1], [1, 2], r"starts and lengths must name spans of the 2 tokens"),
])
def test_spans_and_slots_outside_their_tensors_are_refused(slots: list[int], starts: list[int], lengths: list[int],
                                                           message: str) -> None:
    t = inputs(2, 2, 4, 8, slots=3)
    with pytest.raises(ValueError, match=f"kvloom::ssm_scan_: {message}"):
        ssm.ssm_scan_(t["state"], int64(slots), torch.ones(2, dtype=torch.int32), int64(starts), int64(lengths),
                      t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_mixer_is_the_modules_reference(dtype: torch.dtype) -> None:
    """A mixed step (a continued 6-token chunk, a fresh 9-token prompt, two decodes) through
    Mamba2Mixer.forward natively and by the reference (``prefill_scan`` "ssd"), from the
    same slots: the outputs and every slot's states agree (bf16: to a bf16 rounding of the
    outputs; the SSM states are float32 in both), the convolution's stored inputs exactly."""
    from kvloom.model_families import SSMConfig
    from kvloom.models.mamba2 import Mamba2Mixer

    config = SSMConfig(num_heads=4, head_dim=8, state_size=16, num_groups=2, conv_kernel=4, intermediate_size=32,
                       chunk_size=4, norm_eps=1e-5, layer_kinds=("mamba",))
    torch.manual_seed(3)
    mixers = []
    for _ in range(2):
        torch.manual_seed(3)
        mixer = Mamba2Mixer(24, config).to(dtype)
        with torch.no_grad():
            for parameter in mixer.parameters():
                parameter.copy_(torch.randn_like(parameter) * 0.5)
        mixer.allocate_state(5, torch.device("cpu"), dtype)
        torch.manual_seed(4)
        mixer.conv_state.copy_(torch.randn_like(mixer.conv_state.float()).to(dtype))
        mixer.ssm_state.copy_(torch.randn_like(mixer.ssm_state))
        mixers.append(mixer)
    native, reference = mixers
    reference.prefill_scan = "ssd"
    spans = mixed_step(config.conv_kernel)
    hidden = torch.randn(sum(spans.lengths), 24).to(dtype)
    with torch.no_grad():
        ours, theirs = native(hidden, spans), reference(hidden, spans)
    # bf16: at most one rounding step of the outputs apart (exp's last bit can move one).
    torch.testing.assert_close(ours, theirs, rtol=8e-3 if dtype == torch.bfloat16 else 2e-5, atol=2e-5)
    torch.testing.assert_close(native.ssm_state, reference.ssm_state, rtol=1e-5, atol=1e-5)
    assert torch.equal(native.conv_state, reference.conv_state)


def mixed_step(conv_kernel: int) -> ssm_ops.SSMSpans:
    """A mixed step's spans (a continued 6-token chunk, a fresh 9-token prompt, two decodes)
    in slots 3, 0, 4 and 1 of 5."""
    from kvloom.batch import ForwardBatch

    lengths, seq_lens, slots = [6, 9, 1, 1], [10, 9, 7, 1], [3, 0, 4, 1]
    starts = [sum(lengths[:i]) for i in range(4)]
    tokens = sum(lengths)
    batch = ForwardBatch(
        input_ids=torch.zeros(tokens, dtype=torch.int64), positions=torch.zeros(tokens, dtype=torch.int64),
        slot_mapping=torch.zeros(tokens, dtype=torch.int64), block_tables=torch.zeros(4, 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        logits_indices=torch.zeros(0, dtype=torch.int64), query_lens_list=lengths, seq_lens_list=seq_lens,
        block_size=16, state_slots=torch.tensor(slots, dtype=torch.int64))
    return ssm_ops.SSMSpans.of(batch, conv_kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_short_convolution_is_its_modules_reference(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """LFM2's ShortConv over a mixed step natively and by its torch ops with the reference
    convolution, from the same slots: the outputs agree (bf16: within a rounding step, the
    native sum may fuse a multiply-add), the stored inputs exactly."""
    from kvloom.model_families import ShortConvConfig
    from kvloom.models.short_conv import ShortConv

    layers = []
    for _ in range(2):
        torch.manual_seed(5)
        layer = ShortConv(24, ShortConvConfig(conv_kernel=3, bias=True, layer_kinds=("conv", "attention"))).to(dtype)
        with torch.no_grad():
            for parameter in layer.parameters():
                parameter.copy_(torch.randn_like(parameter) * 0.5)
        layer.pack("invariant")
        layer.allocate_state(5, torch.device("cpu"), dtype)
        torch.manual_seed(6)
        layer.conv_state.copy_(torch.randn_like(layer.conv_state.float()).to(dtype))
        layers.append(layer)
    native, reference = layers
    reference.kernel = "reference"
    spans = mixed_step(3)
    hidden = torch.randn(sum(spans.lengths), 24).to(dtype)
    with torch.no_grad():
        ours = native(hidden, spans)
        monkeypatch.setattr(ssm_ops, "causal_conv", ssm_ops.causal_conv_reference)
        theirs = reference(hidden, spans)
    torch.testing.assert_close(ours, theirs, rtol=8e-3 if dtype == torch.bfloat16 else 2e-5, atol=2e-5)
    assert torch.equal(native.conv_state, reference.conv_state)


def test_the_convolution_and_the_mixer_refuse_slots_and_spans_outside_their_tensors() -> None:
    """They check the requests' slots and spans themselves, before they read or write."""
    xbc, weight_t = torch.randn(3, 6), torch.randn(4, 6)
    conv_state = torch.zeros(2, 3, 6)
    with pytest.raises(ValueError, match=r"kvloom::causal_conv: slots must lie in \[0, 2\), got \[2\]"):
        ssm.causal_conv(xbc, weight_t, None, conv_state, int64([0]), int64([3]), int64([2]),
                        torch.ones(1, dtype=torch.int32))
    assert not conv_state.any()  # nothing written
    with pytest.raises(ValueError, match=r"kvloom::short_conv: slots must lie in \[0, 2\), got \[5\]"):
        ssm.short_conv(torch.randn(3, 18), weight_t, None, conv_state, int64([0]), int64([3]), int64([5]),
                       torch.ones(1, dtype=torch.int32))
    assert not conv_state.any()
    heads, head_dim, d_state, groups = 2, 4, 8, 1
    inter = heads * head_dim
    conv_dim = inter + 2 * groups * d_state
    proj = torch.randn(3, inter + conv_dim + heads)
    with pytest.raises(ValueError, match=r"kvloom::mamba_mixer: starts and lengths must name spans of the 3 tokens"):
        ssm.mamba_mixer(proj, torch.randn(4, conv_dim), None, torch.zeros(2, 3, conv_dim),
                        torch.zeros(2, heads, head_dim, d_state), torch.zeros(heads), torch.zeros(heads),
                        torch.ones(heads), torch.ones(inter), int64([1]), int64([3]), int64([0]),
                        torch.ones(1, dtype=torch.int32), groups, 0.0, float("inf"), 1e-5)


@pytest.mark.skipif("avx512f" not in native.cpu_identity(), reason="this CPU builds the lower paths natively")
def test_a_build_without_avx512_passes_the_same_tests(tmp_path: Path) -> None:
    """ssm.cpp's lower paths (no AVX-512: the AVX2 and scalar code a CPU without it builds,
    Milan's) built here with -mno-avx512f under the name the loader looks for, in a
    home of their own, and this file's other tests and the SSM ops' run against them in a
    subprocess: the same references hold them."""
    import subprocess
    import sys

    home = tmp_path / "home"
    cxx = native.compiler()
    assert cxx is not None
    target = home / "kernels" / f"ssm-{native.build_key('ssm', cxx)}.so"
    native.compile_library(native.SOURCES / "ssm.cpp", target, [*native.flags_for("ssm"), "-mno-avx512f"])
    disassembly = subprocess.run(["objdump", "-d", str(target)], capture_output=True, text=True).stdout
    assert "zmm" not in disassembly  # not vacuous: no AVX-512 register in the build
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not without_avx512",
         "tests/kernels/test_ssm_kernels.py", "tests/models/test_ssm_ops.py"],
        cwd=root, env={**os.environ, "KVLOOM_HOME": str(home)}, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1]
