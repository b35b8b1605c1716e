"""GPT-OSS's attention sinks (one logit per query head that joins each query's softmax
denominator and carries no value) in every backend that takes them: ``cpu_paged`` (the
paired bf16 layout on each path this CPU has, and the token-major float32 and bf16
kernels), ``torch_ref`` and ``triton`` (under Triton's interpreter on CPU), each held to
a naive float64 reference written here and to ``torch_ref``: decodes of several lengths,
prefill chunks after a cached prefix, a sliding window, softcapping with sinks, decodes
walking shared leading blocks together; and sinks of -inf give the kernels' bits
without sinks. 8 query heads on 2 kv heads of 64 dims (GPT-OSS's head_dim)."""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers_cpu import cpu_flags

from kvloom.attention.registry import make_backend
from kvloom.batch import ForwardBatch, ScheduledRequest, SchedulerOutput
from kvloom.kernels import gemm
from kvloom.kernels import paged_attention as kernels
from kvloom.request import Request
from kvloom.sampling_params import SamplingParams

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# Sinks from negligible to dominant against scores of about N(0, 1) over up to 300 keys,
# in an order that gives each kv head's group several.
SINK_VALUES = [-3.0, 6.0, 0.5, 3.0, 4.5, -1.0, 2.0, 8.0]


@dataclass(frozen=True)
class Scenario:
    shapes: list[tuple[int, int]]  # (tokens already computed, tokens this step) per sequence
    window: int = 0
    softcap: float = 0.0


SCENARIOS = {
    # Decodes of several lengths; 300 + 1 keys make two split-K ranges in triton.
    "decodes": Scenario([(0, 1), (5, 1), (40, 1), (100, 1), (300, 1)]),
    # Prefill chunks continuing cached prefixes (one longer than a kernel tile), a fresh one.
    "prefill-chunks": Scenario([(17, 9), (0, 20), (33, 3), (64, 16), (2, 30)]),
    "window": Scenario([(0, 7), (50, 1), (33, 9), (90, 3), (2, 30), (200, 1)], window=21),
    "softcap": Scenario([(17, 9), (40, 1), (0, 20), (150, 1)], softcap=2.0),
}


@dataclass(frozen=True)
class Case:
    """One step: its batch, the step's q/k/v, and every slot's K/V before the step."""

    output: SchedulerOutput
    batch: ForwardBatch  # on CPU
    q: torch.Tensor  # [tokens, HEADS, HEAD_DIM]
    k: torch.Tensor  # [tokens, KV_HEADS, HEAD_DIM]
    v: torch.Tensor
    history: tuple[torch.Tensor, torch.Tensor]  # [slots, KV_HEADS, HEAD_DIM] each
    num_blocks: int
    block_size: int


def make_case(sequences: list[tuple[list[int], int, int]], dtype: torch.dtype, block_size: int,
              num_blocks: int, seed: int = 0) -> Case:
    """``sequences``: (block ids, tokens done, tokens this step) each."""
    scheduled = []
    for i, (blocks, done, new) in enumerate(sequences):
        request = Request(f"s{i}", [1] * (done + new), SamplingParams())
        request.block_ids = list(blocks)
        scheduled.append(ScheduledRequest.of(request, done, new))
    output = SchedulerOutput(1, scheduled)
    batch = ForwardBatch.build(output, block_size, CPU)
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    tokens, slots = batch.num_tokens, num_blocks * block_size
    return Case(output, batch, draw(tokens, HEADS, HEAD_DIM), draw(tokens, KV_HEADS, HEAD_DIM),
                draw(tokens, KV_HEADS, HEAD_DIM), (draw(slots, KV_HEADS, HEAD_DIM), draw(slots, KV_HEADS, HEAD_DIM)),
                num_blocks, block_size)


def scenario_case(scenario: Scenario, dtype: torch.dtype, block_size: int = 16, seed: int = 0) -> Case:
    """The scenario's sequences on shuffled blocks, each its own."""
    rng = random.Random(seed)
    needed = [-(-(done + new) // block_size) for done, new in scenario.shapes]
    pool = rng.sample(range(sum(needed) + 3), sum(needed) + 3)
    sequences, at = [], 0
    for (done, new), count in zip(scenario.shapes, needed, strict=True):
        sequences.append((pool[at:at + count], done, new))
        at += count
    return make_case(sequences, dtype, block_size, len(pool), seed)


def sinks_for(dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(SINK_VALUES).to(dtype)  # the model's dtype: the backends convert


def naive(case: Case, window: int, softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """The oracle, in float64: gather each sequence's K/V (the step's written into its
    slots), scores, softcap, mask, a sink column concatenated, softmax, the column
    dropped, times V. Returns [tokens, HEADS, HEAD_DIM] float64."""
    batch, size = case.batch, case.block_size
    keys, values = (held.double().clone() for held in case.history)
    keys[batch.slot_mapping.long()] = case.k.double()
    values[batch.slot_mapping.long()] = case.v.double()
    group = HEADS // KV_HEADS
    out = torch.empty(batch.num_tokens, HEADS, HEAD_DIM, dtype=torch.float64)
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(batch.query_lens_list, batch.seq_lens_list, strict=True)):
        position = torch.arange(seq_len)
        slots = batch.block_tables[i, position // size].long() * size + position % size
        k = keys[slots].repeat_interleave(group, dim=1)  # [seq_len, HEADS, HEAD_DIM]
        v = values[slots].repeat_interleave(group, dim=1)
        q = case.q[start:start + query_len].double()  # [query_len, HEADS, HEAD_DIM]
        scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM ** -0.5
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        query_position = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
        visible = position.unsqueeze(0) <= query_position  # [query_len, seq_len]
        if window:
            visible &= position.unsqueeze(0) > query_position - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            column = sinks.double().view(HEADS, 1, 1).expand(HEADS, query_len, 1)
            weights = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :seq_len]
        else:
            weights = torch.softmax(scores, dim=-1)
        out[start:start + query_len] = torch.einsum("hqk,khd->qhd", weights, v)
        start += query_len
    return out


def run(name: str, case: Case, window: int, softcap: float, sinks: torch.Tensor | None,
        device: torch.device = CPU) -> torch.Tensor:
    """``name``'s output for the case: the history written into a fresh cache in the
    backend's own layout, then the step."""
    backend = make_backend(name, device, HEADS, KV_HEADS, HEAD_DIM)
    backend.softcap = softcap
    cache = torch.zeros(2, case.num_blocks, case.block_size, KV_HEADS, HEAD_DIM, dtype=case.q.dtype, device=device)
    backend.write_kv(cache, *(held.to(device) for held in case.history),
                     torch.arange(case.num_blocks * case.block_size, device=device))
    batch = case.batch if device.type == "cpu" else ForwardBatch.build(case.output, case.block_size, device)
    q, k, v = (x.to(device) for x in (case.q, case.k, case.v))
    out = backend.forward(q, k, v, cache, batch, backend.prepare(batch), window,
                          None if sinks is None else sinks.to(device))
    return out.cpu()


def assert_matches(actual: torch.Tensor, case: Case, scenario: Scenario, sinks: torch.Tensor) -> None:
    """``actual`` against the naive reference and torch_ref, and the sinks visibly matter."""
    dtype = case.q.dtype
    tolerance = TOLERANCE[dtype]
    expected = naive(case, scenario.window, scenario.softcap, sinks)
    without = naive(case, scenario.window, scenario.softcap, None)
    assert (expected - without).abs().max() > 20 * tolerance  # a kernel ignoring the sinks would fail
    torch.testing.assert_close(actual.double(), expected, atol=tolerance, rtol=tolerance)
    reference = run("torch_ref", case, scenario.window, scenario.softcap, sinks)
    torch.testing.assert_close(actual.float(), reference.float(), atol=tolerance, rtol=tolerance)


def paired_here() -> bool:
    return kernels.available() and kernels.paired_layout(HEAD_DIM, 16)


needs_kernel = pytest.mark.skipif(not kernels.available(), reason="paged_attention.cpp does not build here")
needs_paired = pytest.mark.skipif(not paired_here(), reason="no paired layout on this CPU")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="the CUDA backend's kernels need the triton package")
# bf16 at blocks of 16: the paired layout (where the CPU has it); float32, and bf16 at
# blocks of 5: token-major.
CPU_LAYOUTS = {"bf16-paired": (torch.bfloat16, 16), "f32-token-major": (torch.float32, 16),
               "bf16-token-major": (torch.bfloat16, 5)}


# ---- torch_ref, the oracle of the faster backends ---------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=str)
def test_torch_ref_sinks_match_the_naive_reference(scenario: str, dtype: torch.dtype) -> None:
    case = scenario_case(SCENARIOS[scenario], dtype)
    sinks = sinks_for(dtype)
    actual = run("torch_ref", case, SCENARIOS[scenario].window, SCENARIOS[scenario].softcap, sinks)
    expected = naive(case, SCENARIOS[scenario].window, SCENARIOS[scenario].softcap, sinks)
    torch.testing.assert_close(actual.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


# ---- cpu_paged ------------------------------------------------------------------------
@needs_paired
@pytest.mark.parametrize("scenario", SCENARIOS, ids=str)
def test_cpu_paged_paired_sinks_match_the_references(scenario: str, paired_path: str) -> None:
    """Every paired path this CPU has (AVX2, AVX-512 FMA, vdpbf16ps, AMX: ``paired_path``)."""
    case = scenario_case(SCENARIOS[scenario], torch.bfloat16)
    sinks = sinks_for(torch.bfloat16)
    actual = run("cpu_paged", case, SCENARIOS[scenario].window, SCENARIOS[scenario].softcap, sinks)
    assert_matches(actual, case, SCENARIOS[scenario], sinks)


@needs_kernel
@pytest.mark.parametrize("layout", ["f32-token-major", "bf16-token-major"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=str)
def test_cpu_paged_token_major_sinks_match_the_references(scenario: str, layout: str) -> None:
    dtype, block_size = CPU_LAYOUTS[layout]
    case = scenario_case(SCENARIOS[scenario], dtype, block_size)
    sinks = sinks_for(dtype)
    actual = run("cpu_paged", case, SCENARIOS[scenario].window, SCENARIOS[scenario].softcap, sinks)
    assert_matches(actual, case, SCENARIOS[scenario], sinks)


@needs_paired
def test_cpu_paged_sinks_on_decodes_walking_shared_blocks(paired_path: str) -> None:
    """Decodes whose block tables start with the same 5 blocks (80 tokens): the paired
    kernel walks those together, each query's state suspended and resumed over its own
    blocks, the sinks joining only at the end; the same bits as each sequence alone. (A
    chunk on the same prefix walks alone.)"""
    pool = random.Random(3).sample(range(40), 40)
    prefix, own = pool[:5], iter(pool[5:])

    def blocks(length: int) -> list[int]:
        return prefix + [next(own) for _ in range(-(-length // 16) - len(prefix))]

    sequences = [(blocks(90), 89, 1), (blocks(130), 129, 1), (prefix, 79, 1), (blocks(100), 96, 4),
                 (blocks(100), 80, 20)]
    case = make_case(sequences, torch.bfloat16, 16, len(pool), seed=4)
    # The step's K/V are the history's in their slots: the third decode writes into a shared
    # block (its position 79), which the others then read whether it runs beside them or not.
    slots = case.batch.slot_mapping.long()
    case = Case(case.output, case.batch, case.q, case.history[0][slots], case.history[1][slots], case.history,
                case.num_blocks, 16)
    query_lens = torch.tensor(case.batch.query_lens_list, dtype=torch.int32)
    assert kernels.cascade_members(case.batch.block_tables, case.batch.seq_lens, query_lens, 16) == 4
    sinks = sinks_for(torch.bfloat16)
    together = run("cpu_paged", case, 0, 0.0, sinks)
    assert_matches(together, case, Scenario([]), sinks)
    start = 0
    for i, sequence in enumerate(sequences):
        new = sequence[2]
        alone = make_case([sequence], torch.bfloat16, 16, case.num_blocks)
        rows = slice(start, start + new)
        alone = Case(alone.output, alone.batch, case.q[rows], case.k[rows], case.v[rows], case.history,
                     case.num_blocks, 16)
        assert torch.equal(run("cpu_paged", alone, 0, 0.0, sinks), together[rows]), f"sequence {i}"
        start += new


def assert_minus_infinity_gives_the_bits_without(name: str, scenario: Scenario, dtype: torch.dtype,
                                                 block_size: int = 16,
                                                 device: torch.device = CPU) -> None:
    """Sinks of -inf (exp gives exactly 0 in the sum) against no sinks at all."""
    case = scenario_case(scenario, dtype, block_size)
    none = torch.full((HEADS,), float("-inf"), dtype=dtype)
    with_none = run(name, case, scenario.window, scenario.softcap, none, device)
    assert torch.equal(with_none, run(name, case, scenario.window, scenario.softcap, None, device))


@needs_paired
@pytest.mark.parametrize("scenario", ["decodes", "prefill-chunks", "window", "softcap"])
def test_cpu_paged_paired_sinks_of_minus_infinity_give_the_bits_without(scenario: str, paired_path: str) -> None:
    assert_minus_infinity_gives_the_bits_without("cpu_paged", SCENARIOS[scenario], torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("layout", ["f32-token-major", "bf16-token-major"])
@pytest.mark.parametrize("scenario", ["decodes", "prefill-chunks", "window", "softcap"])
def test_cpu_paged_token_major_sinks_of_minus_infinity_give_the_bits_without(scenario: str, layout: str) -> None:
    dtype, block_size = CPU_LAYOUTS[layout]
    assert_minus_infinity_gives_the_bits_without("cpu_paged", SCENARIOS[scenario], dtype, block_size)


@needs_paired
@pytest.mark.skipif(not {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags(), reason="needs an AVX-512 CPU")
def test_cpu_paged_sinks_avx2_path_gives_the_avx512_fma_bits() -> None:
    """paired_avx2.h promises the AVX-512 FMA path's bits; the sinks' finish is shared."""
    outputs = {}
    try:
        for path in ("avx2", "avx512"):
            assert kernels.set_paired_isa(path) == path
            outputs[path] = [run("cpu_paged", scenario_case(s, torch.bfloat16), s.window, s.softcap,
                                 sinks_for(torch.bfloat16)) for s in SCENARIOS.values()]
    finally:
        kernels.set_paired_isa(kernels.paired_isa())
    for avx2, avx512 in zip(outputs["avx2"], outputs["avx512"], strict=True):
        assert torch.equal(avx2.view(torch.int16), avx512.view(torch.int16))


CHILD = """
import sys, torch
from kvloom.kernels import paged_attention as k
k.load()
assert k.paired_isa() == "avx2", k.paired_isa()
args = torch.load(sys.argv[1])
torch.save(k.paged_attention(*args), sys.argv[2])
"""


@needs_paired
def test_cpu_paged_sinks_under_kvloom_cpu_isa_avx2(tmp_path: Path) -> None:
    """The process-wide cap ($KVLOOM_CPU_ISA=avx2, in a child process) puts the paired
    kernel on its AVX2 path, sinks and all: the reference's output."""
    scenario = SCENARIOS["prefill-chunks"]
    case = scenario_case(scenario, torch.bfloat16)
    backend = make_backend("cpu_paged", CPU, HEADS, KV_HEADS, HEAD_DIM)
    cache = torch.zeros(2, case.num_blocks, 16, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    every_slot = torch.arange(case.num_blocks * 16)
    keys, values = (held.clone() for held in case.history)
    keys[case.batch.slot_mapping.long()], values[case.batch.slot_mapping.long()] = case.k, case.v
    backend.write_kv(cache, keys, values, every_slot)  # the history with the step's K/V in its slots
    rows = backend.prepare(case.batch).every
    sinks = sinks_for(torch.bfloat16).float()
    args = (case.q, cache, rows.block_tables, rows.seq_lens, rows.query_start, rows.query_lens, backend.scale,
            True, 0, 0.0, sinks)
    torch.save(args, tmp_path / "args.pt")
    result = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "args.pt"), str(tmp_path / "out.pt")],
                            capture_output=True, text=True, env=dict(os.environ, **{gemm.ISA_ENV: "avx2"}),
                            cwd=Path(__file__).parents[2], timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    actual = torch.load(tmp_path / "out.pt")
    assert_matches(actual, case, scenario, sinks_for(torch.bfloat16))


# ---- triton ---------------------------------------------------------------------------
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The interpreter takes about a second a step: the split-K decodes (the sinks join in the
# merge), and prefill chunks after cached prefixes beside decodes under a window and a
# softcap at once (one walk per tile; each of the two touches the scores alone).
TRITON_SCENARIOS = {"decodes": SCENARIOS["decodes"],
                    "chunks-window-softcap": Scenario([(17, 9), (40, 1), (33, 9), (2, 30), (90, 3)], window=21,
                                                      softcap=2.0)}


@needs_triton
@pytest.mark.parametrize("scenario", TRITON_SCENARIOS, ids=str)
def test_triton_sinks_match_the_references(scenario: str) -> None:
    """float32: the interpreter multiplies bf16 tiles in float32 anyway."""
    case = scenario_case(TRITON_SCENARIOS[scenario], torch.float32)
    sinks = sinks_for(torch.float32)
    actual = run("triton", case, TRITON_SCENARIOS[scenario].window, TRITON_SCENARIOS[scenario].softcap, sinks,
                 TRITON_DEVICE)
    assert_matches(actual, case, TRITON_SCENARIOS[scenario], sinks)


@needs_triton
def test_triton_sinks_of_minus_infinity_give_the_bits_without() -> None:
    assert_minus_infinity_gives_the_bits_without("triton", Scenario([(5, 4), (20, 1)], softcap=2.0), torch.float32,
                                                 device=TRITON_DEVICE)


@needs_kernel
def test_wrong_sinks_raise_naming_them() -> None:
    case = scenario_case(SCENARIOS["decodes"], torch.float32)
    backend = make_backend("cpu_paged", CPU, HEADS, KV_HEADS, HEAD_DIM)
    rows = backend.prepare(case.batch).every
    cache = torch.zeros(2, case.num_blocks, 16, KV_HEADS, HEAD_DIM)
    args = (case.q, cache, rows.block_tables, rows.seq_lens, rows.query_start, rows.query_lens, 0.125, False, 0, 0.0)
    for wrong, message in [(torch.zeros(HEADS, dtype=torch.bfloat16), "must be a contiguous 1-D float32"),
                           (torch.zeros(HEADS * 2)[::2], "must be a contiguous 1-D float32"),
                           (torch.zeros(HEADS - 1), r"must hold one logit per query head, \[8\] float32, got \[7\]")]:
        with pytest.raises(ValueError, match=rf"^kvloom::paged_attention: sinks {message}"):
            kernels.paged_attention(*args, sinks=wrong)
