"""Linear layers whose CPU bf16 weights are packed once at load time, by matmul choice.

``EngineConfig.matmul`` names the kernel behind every ``nn.Linear`` of the model:

- ``invariant`` (default): :class:`InvariantLinear`, kvloom's own GEMM
  (kernels/gemm.py): a row's result never depends on how many rows share the call,
  so a request's tokens do not depend on the batch, chunking, prefix hits or
  preemption. At decode sizes it is also faster than oneDNN here
  (docs/benchmarks.md has the numbers, by CPU).
- ``onednn``: :class:`PackedLinear`, oneDNN with the weight prepacked (bit-identical
  to ``F.linear`` where the CPU has native bf16; where oneDNN emulates bf16 in float32
  some shapes differ by a rounding). oneDNN chooses its kernel, and so its reduction
  order, by the number of rows: outputs then change with what else is in the step.
- ``torch``: plain ``F.linear`` (oneDNN repacks the weight on every call).

Only bf16 weights on CPU are packed. Float32 on CPU stays on ``F.linear`` (MKL, the
reference dtype's library); under ``invariant`` through :class:`Float32Linear`, which
pads each call, where MKL needs it, to a row count where MKL gives a row the same bits
whatever the count.
Other devices keep their own libraries.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.config import MATMULS
from kvloom.kernels import gemm
from kvloom.native import KernelUnavailable

logger = logging.getLogger(__name__)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether this weight would be served by a prepacked oneDNN matmul here."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def can_pack_invariant(weight: torch.Tensor) -> bool:
    """Whether kvloom's batch-invariant GEMM serves this weight here."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and gemm.default_isa() is not None


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's blocked layout (an opaque tensor).

    Why: ``F.linear`` on a plain bf16 weight lets oneDNN re-lay the weight out on every
    call; for decode-shaped matmuls that repacking costs as much as the multiply
    (decode at batch 16 went from 61.5 to 47.4 ms). The packed weight is a buffer, not
    a parameter: build a new model to load new weights.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # The batch-size hint only steers oneDNN's layout choice; measured equal speed
        # for hints 1..512 at every batch size, so decode's typical size is given.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 16)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


class InvariantLinear(nn.Module):
    """y = x @ W.T + b on kvloom's batch-invariant GEMM, W packed for it once.

    ``isa`` is the kernel path (kernels/gemm.py), fixed per module so that every call
    of a model runs the same arithmetic. ``packed``: the weight already packed (one of
    ``gemm.pack_weights``'s views, as :func:`pack_linear_layers` hands them out).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, isa: str | None = None,
                 packed: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.isa = isa or gemm.default_isa()
        if self.isa is None:
            raise KernelUnavailable("the batch-invariant GEMM does not run on this CPU")
        self.packed_weight = gemm.pack_weight(weight) if packed is None else packed
        self.bias = None if bias is None else bias.detach().contiguous().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous():  # the model's case: [tokens, in_features]
            return gemm.gemm_bf16(x, self.packed_weight, self.bias, self.out_features, self.isa)
        rows = x.reshape(-1, self.in_features).contiguous()  # [tokens, in_features]
        y = gemm.gemm_bf16(rows, self.packed_weight, self.bias, self.out_features, self.isa)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=kvloom/{self.isa}"


# MKL's float32 GEMM (torch 2.13's, 2024.2) on AMD EPYC Milan (AVX2) takes other kernels
# for 1-11 rows unless the count is a multiple of 4, and a row's bits then depend on how
# many rows share the call: a prefix hit's 11 computed tokens rounded differently from the
# same tokens inside the whole prompt. From 12 rows, and at 4 and 8, each row gets the
# same bits as in any larger call (every M from 1 to 200, at any offset, nine shapes with
# and without a bias). The AVX-512 CPUs' MKL showed no such kernel, and padding costs
# there: one row takes MKL's matrix-vector kernel, which reads the weight once, where 4
# rows pack it first (float32 decode at batch 1 on Milan: 50 -> 90 ms a step, the price
# of its exactness there; docs/benchmarks.md). So padding is on only where a probe finds it
# needed.
FLOAT32_ROWS_ANY = 12
FLOAT32_ROWS_MULTIPLE = 4


def float32_rows(rows: int) -> int:
    """The row count a float32 call of ``rows`` rows is padded to where padding is on."""
    if rows >= FLOAT32_ROWS_ANY or rows % FLOAT32_ROWS_MULTIPLE == 0:
        return rows
    return -(-rows // FLOAT32_ROWS_MULTIPLE) * FLOAT32_ROWS_MULTIPLE


@functools.cache
def float32_rows_need_padding() -> bool:
    """Whether MKL's float32 GEMM here gives some of rows 1-11 other bits than the same
    rows in a larger call (one probe a process, with the thread count it then has)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 96, generator=generator)
    x = torch.randn(2 * FLOAT32_ROWS_ANY, 96, generator=generator)
    whole = F.linear(x, weight)
    return any(not torch.equal(F.linear(x[:rows], weight), whole[:rows]) for rows in range(1, FLOAT32_ROWS_ANY))


class Float32Linear(nn.Module):
    """y = x @ W.T + b for float32 on CPU through ``F.linear`` (MKL), where MKL needs it
    (:func:`float32_rows_need_padding`) each call padded with zero rows to
    :func:`float32_rows`, so that a row's result does not depend on how many rows share
    the call: a request's tokens then do not depend on the batch, chunking or prefix hits
    in float32 either. The weight is held, not copied (a tied head shares the embedding
    table). ``pad``: None asks the probe."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pad: bool | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.pad = float32_rows_need_padding() if pad is None else pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        count = rows.shape[0]
        padded = float32_rows(count) if self.pad else count
        if padded != count:
            rows = torch.cat((rows, rows.new_zeros(padded - count, self.in_features)))
        y = F.linear(rows, self.weight, self.bias)[:count]
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float32, rows padded={self.pad}"


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None, matmul: str) -> nn.Module | None:
    """The packed layer ``matmul`` asks for, or None where it does not apply (dtype,
    device, CPU): the caller keeps its ``nn.Linear``."""
    if matmul not in MATMULS:
        raise ValueError(f"matmul must be one of {MATMULS}, got {matmul!r}")
    if matmul == "invariant" and can_pack_invariant(weight):
        return InvariantLinear(weight, bias)
    if matmul == "invariant" and weight.device.type == "cpu" and weight.dtype == torch.float32:
        return Float32Linear(weight, bias)
    if matmul == "onednn" and can_pack(weight):
        return PackedLinear(weight, bias)
    return None


@runtime_checkable
class PacksItself(Protocol):
    """A module holding matmul weights outside ``nn.Linear`` (the MoE's 3D expert
    tensors): ``pack(matmul)`` packs them itself and returns how many layers."""

    def pack(self, matmul: str) -> int: ...


def packed_linears(layers: Sequence[tuple[torch.Tensor, torch.Tensor | None]], matmul: str) -> list[nn.Module | None]:
    """:func:`packed_linear` of each (weight, bias), in order; for ``invariant``, the
    weights the GEMM serves are packed together, in that order, into one buffer on 2 MiB
    pages (``gemm.pack_weights``: a decode step streams them all from memory)."""
    if matmul != "invariant":
        return [packed_linear(weight, bias, matmul) for weight, bias in layers]
    served = [can_pack_invariant(weight) for weight, _ in layers]
    packed = iter(gemm.pack_weights([weight for (weight, _), ok in zip(layers, served, strict=True) if ok]))
    return [InvariantLinear(weight, bias, packed=next(packed)) if ok else packed_linear(weight, bias, matmul)
            for (weight, bias), ok in zip(layers, served, strict=True)]


def pack_linear_layers(model: nn.Module, matmul: str = "invariant", tied_head: torch.Tensor | None = None) -> int:
    """Swap every packable ``nn.Linear`` in ``model`` for the ``matmul`` choice's packed
    layer, in place, and have every ``PacksItself`` module pack its own weights; with
    ``tied_head`` (the embedding table of a model whose ``lm_head`` is None), also make
    ``model.lm_head`` a packed copy of it where the kernel applies (vocab x hidden more
    memory: the lookup needs the plain table). Returns how many were packed (0 where
    nothing qualifies)."""
    count = sum(module.pack(matmul) for module in list(model.modules()) if isinstance(module, PacksItself))
    swaps: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor | None]] = [
        (parent, name, child.weight, child.bias) for parent in model.modules()
        for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    if tied_head is not None:
        swaps.append((model, "lm_head", tied_head, None))
    layers = packed_linears([(weight, bias) for _, _, weight, bias in swaps], matmul)
    for (parent, name, _, _), layer in zip(swaps, layers, strict=True):
        if layer is not None:
            setattr(parent, name, layer)
            count += 1
    if matmul == "invariant" and swaps and count == 0 and swaps[0][2].dtype == torch.bfloat16:
        logger.warning("bf16 matmuls run on F.linear: outputs may depend on the batch (no invariant GEMM here)")
    return count


def pack_with_tied_head(model: nn.Module, embedding: torch.Tensor, matmul: str) -> int:
    """``pack_linear_layers``, with the embedding table as the head of a model whose
    output head is its embedding (``model.lm_head`` None). Every model's
    ``pack_weights`` ends here."""
    tied = embedding if getattr(model, "lm_head", None) is None else None
    return pack_linear_layers(model, matmul, tied_head=tied)
