"""Linear layers whose weights stay MXFP4 (kvloom/csrc/mxfp4_gemm.cpp) as the op
``kvloom::mxfp4_linear``, the format's dequantization, and :class:`MXFP4Linear`.

MXFP4 (OCP microscaling; GPT-OSS's experts): a weight W [n, k] is ``blocks`` [n, k / 32, 16]
uint8, byte b of group g of row r holding W[r, 32g + 2b] in its low nibble and
W[r, 32g + 2b + 1] in its high one (e2m1 codes, :data:`E2M1_VALUES`), and ``scales``
[n, k / 32] uint8, group g of row r multiplied by 2 ** (scale - 127) (e8m0).

``mxfp4_linear(x, blocks, scales, bias)`` is y = x @ W.T (+ bias) for bf16 or float32 x on
CPU without materialising W: 4.25 bits a weight read once, float32 accumulation, one
rounding to x's dtype. Every output is computed by the same operations in the same order
whatever the other rows of x and however the threads split the work (over n only), so a
row gives the same bits alone as in any batch. The paths (:data:`ISAS`) compute the same
operations: float32 x gets the same bits on every path, bf16 x too except where x or a
running sum is below 2 ** -126 (vdpbf16ps flushes those). ``$KVLOOM_CPU_ISA`` caps the
default path as it caps the GEMM's (kernels/gemm.py).

:func:`mxfp4_linear_reference` (dequantize, float64 matmul, one rounding) is the oracle.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.kernels import gemm
from kvloom.kernels.native_op import NativeFunction, NativeOp, TensorSpec, dtype_name

GROUP = 32  # weights sharing a scale; k must be a multiple
# The 16 values of an e2m1 code (sign, two exponent bits, one mantissa bit).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
ISAS = ("scalar", "avx2", "avx512", "avx512_bf16")  # worst to best; the index is mxfp4_gemm.cpp's enum
ACTIVATIONS = (torch.float32, torch.bfloat16)
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_UINT8 = (torch.uint8,)
_BEST_ISA = NativeFunction("mxfp4_gemm", "kvloom_mxfp4_best_isa() -> int32")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 ``blocks`` [..., groups, 16] uint8 and ``scales`` [..., groups] uint8 ->
    [..., groups * 32] of ``dtype``: each code's value times 2 ** (scale - 127), computed in
    float32 (exact: a value has two significant bits; a scale of 255 gives inf, and NaN
    for the zero codes, as torch.ldexp does) and converted once."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: "
                         "blocks must be [..., groups, 16] and scales [..., groups]")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., groups, 16, 2]: numbers 2b, 2b + 1
    values = table[codes].flatten(-2)  # [..., groups, 32]
    exponents = (scales.to(torch.int32) - 127).unsqueeze(-1).float()  # [..., groups, 1]
    return torch.ldexp(values, exponents).flatten(-2).to(dtype)  # [..., groups * 32]


def mxfp4_linear_reference(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: W dequantized (exact in float32), x @ W.T (+ bias) in float64, rounded
    once to x's dtype. Any device and float dtype."""
    weight = dequantize_mxfp4(blocks, scales, torch.float32)  # [n, k]
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


# ---- the op -------------------------------------------------------------------------
MXFP4_LINEAR = NativeOp(
    "mxfp4_linear(Tensor x, Tensor blocks, Tensor scales, Tensor? bias, str isa) -> Tensor",
    library="mxfp4_gemm",
    native="kvloom_mxfp4_linear(x, blocks, scales, bias, Tensor y, int m, int n, int k, int32 dtype, int32 isa, "
           "int32 num_threads) -> int32",
    tensors={"x": TensorSpec(2, ACTIVATIONS), "blocks": TensorSpec(3, _UINT8), "scales": TensorSpec(2, _UINT8),
             "bias": TensorSpec(1, like="x")},
)


@MXFP4_LINEAR.check
def _mxfp4_linear_check(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                        isa: str) -> None:
    n, groups, k = blocks.shape[0], blocks.shape[1], x.shape[1]
    if k % GROUP:
        raise MXFP4_LINEAR.error("x", f"has {k} columns (inputs); MXFP4 needs a multiple of {GROUP}")
    if blocks.shape[2] != GROUP // 2 or groups * GROUP != k:
        raise MXFP4_LINEAR.error("blocks", f"must be [n, {k // GROUP}, 16] for x's {k} inputs, "
                                           f"got {list(blocks.shape)}")
    if scales.shape != (n, groups):
        raise MXFP4_LINEAR.error("scales", f"must be [{n}, {groups}] (one per group of blocks), "
                                           f"got {list(scales.shape)}")
    if bias is not None and bias.shape[0] != n:
        raise MXFP4_LINEAR.error("bias", f"must have one value per output, [{n}], got {list(bias.shape)}")
    if isa not in ISAS:
        raise MXFP4_LINEAR.error("isa", f"must be one of {ISAS}, got {isa!r}")


def _path(isa: str, dtype: torch.dtype) -> int:
    """The enum of the path ``isa`` names for x of ``dtype``: float32 x takes the fma
    paths, so ``avx512_bf16`` runs ``avx512`` for it (the same operations)."""
    code = ISAS.index(isa)
    return min(code, ISAS.index("avx512")) if dtype == torch.float32 else code


@MXFP4_LINEAR.implementation
def _mxfp4_linear_cpu(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                      isa: str) -> torch.Tensor:
    m, k = x.shape
    n = blocks.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    status = MXFP4_LINEAR.function()(
        x.data_ptr(), blocks.data_ptr(), scales.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
        m, n, k, _DTYPE_CODES[x.dtype], _path(isa, x.dtype), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"kvloom::mxfp4_linear: this CPU does not run the {isa!r} path for "
                           f"{dtype_name(x.dtype)} x (it runs {supported_isas()})")
    return y


@MXFP4_LINEAR.fake
def _mxfp4_linear_fake(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                       isa: str) -> torch.Tensor:
    return x.new_empty(x.shape[0], blocks.shape[0])


def available() -> bool:
    """Whether mxfp4_gemm.cpp builds here; where not, callers dequantize (:func:`dequantize_mxfp4`)."""
    return MXFP4_LINEAR.available()


def supported_isas() -> tuple[str, ...]:
    """Every path this CPU runs, worst to best (empty where the kernel does not build)."""
    return ISAS[:_BEST_ISA.function()() + 1] if _BEST_ISA.available() else ()


@functools.cache
def default_isa() -> str:
    """The best path this CPU runs, no better than ``$KVLOOM_CPU_ISA`` names (one of the
    GEMM's paths: ``amx`` caps nothing here); ``scalar`` where nothing better runs."""
    supported = supported_isas() or ISAS[:1]
    cap = os.environ.get(gemm.ISA_ENV)
    if cap is not None and cap not in gemm.ISAS:
        raise ValueError(f"{gemm.ISA_ENV} must be one of {gemm.ISAS}, got {cap!r}")
    if cap is not None and cap in ISAS:
        supported = tuple(isa for isa in supported if ISAS.index(isa) <= ISAS.index(cap))
    return supported[-1]


def mxfp4_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 isa: str | None = None) -> torch.Tensor:
    """y [m, n] = x [m, k] @ W.T (+ bias) for W the MXFP4 pair ``blocks`` [n, k / 32, 16] and
    ``scales`` [n, k / 32] (uint8), x contiguous bf16 or float32 on CPU, bias [n] of x's
    dtype; y of x's dtype. ``isa``: the best path to take (:data:`ISAS`; default
    :func:`default_isa`). Wrong arguments raise ``ValueError("kvloom::mxfp4_linear: <argument> ...")``."""
    y: torch.Tensor = MXFP4_LINEAR.call(x, blocks, scales, bias, default_isa() if isa is None else isa)
    return y


class MXFP4Linear(nn.Module):
    """A linear layer whose weight stays MXFP4: ``forward(x)`` is x @ W.T (+ bias) over x's
    last dim through :func:`mxfp4_linear` (bf16 or float32 x on CPU where the kernel
    builds; elsewhere W dequantized to x's dtype and ``F.linear``).

    ``blocks`` [out_features, in_features / 32, 16] and ``scales`` [out_features,
    in_features / 32] (uint8), ``bias`` [out_features] or None, are kept as given
    (contiguous views stay views of their owner's tensors), as buffers so ``.to()`` moves
    them; not persistent: the owner (a checkpoint's tensors) saves them once. ``isa``: the
    kernel's path, fixed per module (default :func:`default_isa`)."""

    blocks: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 isa: str | None = None) -> None:
        super().__init__()
        if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[2] != GROUP // 2:
            raise ValueError(f"MXFP4Linear: blocks must be [out_features, in_features / 32, 16] uint8, "
                             f"got {list(blocks.shape)} {dtype_name(blocks.dtype)}")
        if scales.dtype != torch.uint8 or scales.shape != blocks.shape[:2]:
            raise ValueError(f"MXFP4Linear: scales must be {list(blocks.shape[:2])} uint8 (one per group of "
                             f"blocks), got {list(scales.shape)} {dtype_name(scales.dtype)}")
        if bias is not None and bias.shape != blocks.shape[:1]:
            raise ValueError(f"MXFP4Linear: bias must be [{blocks.shape[0]}], got {list(bias.shape)}")
        if isa is not None and isa not in ISAS:
            raise ValueError(f"MXFP4Linear: isa must be one of {ISAS}, got {isa!r}")
        self.out_features, self.in_features = blocks.shape[0], blocks.shape[1] * GROUP
        self.isa = isa or default_isa()
        self.register_buffer("blocks", blocks.detach().contiguous(), persistent=False)
        self.register_buffer("scales", scales.detach().contiguous(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [tokens, in_features]
        bias = self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        if x.is_cpu and self.blocks.is_cpu and x.dtype in ACTIVATIONS and available():
            y = mxfp4_linear(rows.contiguous(), self.blocks, self.scales, bias, self.isa)
        else:
            y = F.linear(rows, dequantize_mxfp4(self.blocks, self.scales, x.dtype), bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mxfp4=kvloom/{self.isa}"
