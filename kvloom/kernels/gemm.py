"""The batch-invariant bf16 matmul (kvloom/csrc/gemm.cpp) as the op ``kvloom::gemm_bf16``.

y = x @ W.T (+ bias) with W prepacked once by :func:`pack_weight`. Every output element
is one float32 sum over K in a fixed order, so a row's result does not depend on how
many rows share the call (oneDNN's does: it picks kernels by row count; measurements
in docs/benchmarks.md). That is what makes a request's tokens independent of the batch,
the chunk size, prefix hits and preemption in bf16.

The path is chosen at run time from what the CPU runs, best first: ``amx`` (tile dot
products), ``avx512_bf16`` (vdpbf16ps), ``avx512`` and ``avx2`` (float32 fma). Each
path is invariant on its own; they differ from each other in rounding. Set
``KVLOOM_CPU_ISA`` to one of those names to cap the choice (tests use it to run the
lower paths on one machine). The AMX path is checked against ``avx512_bf16`` once per
process before it is used, and left out, with an error in the log, if they disagree.

:func:`gemm_reference` (float32 matmul, rounded once) is the oracle in tests.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
from collections.abc import Sequence

import torch

from kvloom.kernels.huge_pages import empty_on_huge_pages
from kvloom.kernels.native_op import NativeFunction, NativeOp, TensorSpec

ISAS = ("avx2", "avx512", "avx512_bf16", "amx")  # worst to best; index + 1 is gemm.cpp's enum
ISA_ENV = "KVLOOM_CPU_ISA"
logger = logging.getLogger(__name__)
_BF16 = (torch.bfloat16,)
_BEST_ISA = NativeFunction("gemm", "kvloom_gemm_best_isa() -> int32")
# The same matmul, fetching a side stream of the caller's lines as it computes
# (csrc/side_stream.h): the decoder stack's entry point for its matmuls.
GEMM_SIDE = NativeFunction("gemm", "kvloom_gemm_bf16_side(Tensor x, Tensor packed, Tensor bias, Tensor y, int m, "
                                   "int n, int k, int32 isa, int32 num_threads, Tensor side) -> int32")
_PACKED_ELEMENTS = NativeFunction("gemm", "kvloom_gemm_packed_elements(int n, int k) -> int")


def supported_isas() -> tuple[str, ...]:
    """Every path this CPU runs, worst to best (empty where the kernel cannot build or
    the CPU lacks AVX2)."""
    return ISAS[:_BEST_ISA.function()()] if _BEST_ISA.available() else ()


@functools.cache
def default_isa() -> str | None:
    """The path the engine uses: the best one, capped by ``$KVLOOM_CPU_ISA``; None where
    there is none (the caller then keeps ``F.linear``)."""
    supported = supported_isas()
    cap = os.environ.get(ISA_ENV)
    if cap is not None and cap not in ISAS:
        raise ValueError(f"{ISA_ENV} must be one of {ISAS}, got {cap!r}")
    if cap is not None:
        supported = tuple(isa for isa in supported if ISAS.index(isa) <= ISAS.index(cap))
    if supported and supported[-1] == "amx" and not amx_verified():
        supported = supported[:-1]
    return supported[-1] if supported else None


_AMX_PROBE = ("import sys\nfrom kvloom.kernels.gemm import amx_agrees\n"
              "sys.exit(0 if amx_agrees() else 3)\n")


def amx_verified() -> bool:
    """Whether this build's AMX path may be used: it ran in a child process (so that a
    faulty build can crash that process, not the engine) and matched AVX512-BF16. The
    verdict is kept beside the build, so each machine and build pays it once."""
    from kvloom import native

    if not _BEST_ISA.available():
        return False
    verdict_path = native.cache_dir() / f"gemm-{native.build_key('gemm', native.compiler() or 'g++')}.amx"
    if verdict_path.exists():
        verdict = verdict_path.read_text()
    else:
        verdict = probe_verdict(_AMX_PROBE)
        native.write_atomically(verdict_path, verdict)
    if verdict != "ok":
        logger.error("the AMX matmul is left out (AVX512-BF16 is used): %s", verdict)
    return verdict == "ok"


def probe_verdict(code: str, timeout: float = 300.0) -> str:
    """Run ``code`` in a fresh interpreter: "ok" when it exits 0, else why not."""
    try:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"the probe did not finish in {timeout:.0f} s"
    if result.returncode == 0:
        return "ok"
    if result.returncode == 3:
        return "its results disagree with AVX512-BF16"
    tail = result.stderr.strip().splitlines()[-1:] or ["no output"]
    return f"the probe process ended with status {result.returncode} ({tail[0][:200]})"


def amx_agrees() -> bool:
    """Whether the AMX path matches the AVX512-BF16 path (to rounding) on a small
    problem with every kind of tail: a guard that keeps a faulty AMX build out."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 70, generator=generator).bfloat16()
    bias = torch.randn(50, generator=generator).bfloat16()
    x = torch.randn(37, 70, generator=generator).bfloat16()
    packed = pack_weight(weight)
    amx = gemm_bf16(x, packed, bias, 50, "amx").float()
    vector = gemm_bf16(x, packed, bias, 50, "avx512_bf16").float()
    if torch.allclose(amx, vector, rtol=2e-2, atol=2e-2):
        return True
    logger.error("the AMX matmul disagrees with AVX512-BF16 (max difference %.3g): AMX left out",
                 (amx - vector).abs().max().item())
    return False


def packed_elements(n: int, k: int) -> int:
    """bf16 elements of a packed [n, k] weight: n padded to 16 columns, k to 32 (gemm.cpp)."""
    return -(-n // 16) * 16 * (-(-k // 32) * 32)


def _check_packable(weight: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        raise ValueError(f"pack_weight takes a 2-D bf16 CPU tensor, got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}")
    n, k = weight.shape
    assert _PACKED_ELEMENTS.function()(n, k) == packed_elements(n, k)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> the packed layout (a flat bf16 tensor; see gemm.cpp)."""
    _check_packable(weight)
    return GEMM_PACK.call(weight.detach().contiguous())


def pack_weights(weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each [N, K] bf16 weight packed as :func:`pack_weight` packs it, all of them one
    after another in one buffer on 2 MiB pages (kernels/huge_pages.py), in the order
    given (a model's: the order a step reads them). A decode step streams every weight
    from memory; on 4 KiB pages each thread's share of a matmul is a run of TLB misses.
    Out of cache, the default model's 30 layers and head on AMD EPYC model 17: M = 1
    8.9 -> 8.2-8.4 ms, M = 16 13.2-13.7 -> 12.3-13.1, M = 64 2% (docs/benchmarks.md).
    Each result is a view of the buffer (which it keeps alive), at a multiple of 1 KiB
    (a packed size is a multiple of 16 x 32 elements)."""
    for weight in weights:
        _check_packable(weight)
    sizes = [packed_elements(*weight.shape) for weight in weights]
    buffer = empty_on_huge_pages(sum(sizes), torch.bfloat16)
    views, start = [], 0
    for weight, size in zip(weights, sizes, strict=True):
        view = buffer[start:start + size]
        contiguous = weight.detach().contiguous()
        GEMM_PACK.function()(contiguous.data_ptr(), weight.shape[0], weight.shape[1], view.data_ptr())
        views.append(view)
        start += size
    return views


def pack_weight_groups(groups: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """Each group's weights (one shape a group) packed as :func:`pack_weights` packs them,
    every group in one buffer on 2 MiB pages, group after group: per group a [len(group),
    packed elements] tensor, row i its weight i packed (what :func:`gemm_grouped_bf16`
    takes; a mixture-of-experts layer's experts' gate/up weights, then their down
    weights)."""
    for group in groups:
        if len({tuple(weight.shape) for weight in group}) > 1:
            raise ValueError(f"a group's weights must share one shape, got {[tuple(w.shape) for w in group]}")
    views = iter(pack_weights([weight for group in groups for weight in group]))
    stacked = []
    for group in groups:
        rows = [next(views) for _ in group]
        size = rows[0].shape[0] if rows else 0
        # pack_weights lays them one after another: row i starts where row i - 1 ends
        assert all(row.data_ptr() == rows[0].data_ptr() + 2 * size * i for i, row in enumerate(rows))
        stacked.append(rows[0].as_strided((len(rows), size), (size, 1)) if rows
                       else torch.empty(0, 0, dtype=torch.bfloat16))
    return stacked


def gemm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The oracle: a float32 matmul (and bias add), rounded to bf16 once."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.bfloat16)


# ---- the ops ------------------------------------------------------------------------
GEMM_PACK = NativeOp(
    "gemm_pack(Tensor weight) -> Tensor",
    library="gemm",
    native="kvloom_gemm_pack(weight, int n, int k, Tensor packed) -> ()",
    tensors={"weight": TensorSpec(2, _BF16)},
)


@GEMM_PACK.implementation
def _gemm_pack_cpu(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    packed = torch.empty(packed_elements(n, k), dtype=torch.bfloat16)
    GEMM_PACK.function()(weight.data_ptr(), n, k, packed.data_ptr())
    return packed


@GEMM_PACK.fake
def _gemm_pack_fake(weight: torch.Tensor) -> torch.Tensor:
    return weight.new_empty(packed_elements(weight.shape[0], weight.shape[1]))


# A plain kernel registration (NativeOp) rather than torch.library.custom_op: the same
# schema and checks at a third of the call cost (3.6 vs 10.7 us measured through
# torch.ops), which a decode step of 121 matmuls feels.
GEMM = NativeOp(
    "gemm_bf16(Tensor x, Tensor packed, Tensor? bias, int out_features, str isa) -> Tensor",
    library="gemm",
    native="kvloom_gemm_bf16(x, packed, bias, Tensor y, int m, int n, int k, int32 isa, int32 num_threads) -> int32",
    tensors={"x": TensorSpec(2, _BF16), "packed": TensorSpec(1, _BF16), "bias": TensorSpec(1, _BF16)},
)


@GEMM.check
def _gemm_check(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int, isa: str) -> None:
    expected = packed_elements(out_features, x.shape[1])
    if packed.shape[0] != expected:
        raise GEMM.error("packed", f"has {packed.shape[0]} elements, a [{out_features}, {x.shape[1]}] weight "
                                   f"packs to {expected}")
    if bias is not None and bias.shape[0] != out_features:
        raise GEMM.error("bias", f"must be a contiguous [{out_features}] bf16 tensor, got {list(bias.shape)}")
    if isa not in _ISA_ENUM:
        raise GEMM.error("isa", f"must be one of {ISAS}, got {isa!r}")


_ISA_ENUM = {isa: index + 1 for index, isa in enumerate(ISAS)}


def isa_code(isa: str) -> int:
    """gemm.cpp's enum value for a path name (what its C entry point takes)."""
    if isa not in _ISA_ENUM:
        raise ValueError(f"unknown GEMM path {isa!r}; the paths are {ISAS}")
    return _ISA_ENUM[isa]


@GEMM.implementation
def _gemm_cpu(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
              isa: str) -> torch.Tensor:
    y = torch.empty(x.shape[0], out_features, dtype=torch.bfloat16)
    status = GEMM.function()(
        x.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
        x.shape[0], out_features, x.shape[1], _ISA_ENUM[isa], torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"kvloom::gemm_bf16: this CPU does not run the {isa!r} path "
                           f"(it runs {supported_isas()})")
    return y


@GEMM.fake
def _gemm_fake(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
               isa: str) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def gemm_bf16(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
              isa: str) -> torch.Tensor:
    """y[M, out_features] = x[M, K] @ W.T (+ bias) on the given path (see the module doc)."""
    return GEMM.call(x, packed, bias, out_features, isa)


GEMM_GROUPED = NativeOp(
    "gemm_grouped_bf16(Tensor x, Tensor packed, Tensor starts, int out_features, str isa) -> Tensor",
    library="gemm",
    native="kvloom_gemm_grouped_bf16(x, packed, starts, Tensor y, int groups, int m, int n, int k, "
           "int weight_stride, int32 isa, int32 num_threads) -> int32",
    tensors={"x": TensorSpec(2, _BF16), "packed": TensorSpec(2, _BF16, rows=True),
             "starts": TensorSpec(1, (torch.int64,))},
)


@GEMM_GROUPED.check
def _gemm_grouped_check(x: torch.Tensor, packed: torch.Tensor, starts: torch.Tensor, out_features: int,
                        isa: str) -> None:
    expected = packed_elements(out_features, x.shape[1])
    if packed.shape[1] != expected:
        raise GEMM_GROUPED.error("packed", f"rows have {packed.shape[1]} elements, a [{out_features}, "
                                           f"{x.shape[1]}] weight packs to {expected}")
    if starts.shape[0] != packed.shape[0] + 1:
        raise GEMM_GROUPED.error("starts", f"must have one entry per weight and one more ({packed.shape[0] + 1}), "
                                           f"got {starts.shape[0]}")
    if isa not in _ISA_ENUM:
        raise GEMM_GROUPED.error("isa", f"must be one of {ISAS}, got {isa!r}")


@GEMM_GROUPED.implementation
def _gemm_grouped_cpu(x: torch.Tensor, packed: torch.Tensor, starts: torch.Tensor, out_features: int,
                      isa: str) -> torch.Tensor:
    y = torch.empty(x.shape[0], out_features, dtype=torch.bfloat16)
    status = GEMM_GROUPED.function()(
        x.data_ptr(), packed.data_ptr(), starts.data_ptr(), y.data_ptr(), packed.shape[0], x.shape[0],
        out_features, x.shape[1], packed.stride(0), _ISA_ENUM[isa], torch.get_num_threads())
    if status == -1:
        raise RuntimeError(f"kvloom::gemm_grouped_bf16: this CPU does not run the {isa!r} path "
                           f"(it runs {supported_isas()})")
    if status == -2:
        raise GEMM_GROUPED.error("starts", f"must rise from 0 to x's {x.shape[0]} rows, got {starts.tolist()}")
    return y


@GEMM_GROUPED.fake
def _gemm_grouped_fake(x: torch.Tensor, packed: torch.Tensor, starts: torch.Tensor, out_features: int,
                       isa: str) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def gemm_grouped_bf16(x: torch.Tensor, packed: torch.Tensor, starts: torch.Tensor, out_features: int,
                      isa: str) -> torch.Tensor:
    """Rows [starts[g], starts[g + 1]) of the result = those rows of x @ W_g.T, W_g packed
    as ``packed[g]`` (:func:`pack_weight_groups`): each row's bits are
    :func:`gemm_bf16`'s with its group's weight. ``starts``: [groups + 1] int64, rising
    from 0 to x's rows (a group may have none)."""
    return GEMM_GROUPED.call(x, packed, starts, out_features, isa)
