"""Linear layers whose weights are prepacked once for oneDNN (CPU, bfloat16).

Why: ``F.linear`` on a plain bf16 weight lets oneDNN re-lay the weight out on every
call; for decode-shaped matmuls (a few rows against a large weight) that repacking
costs as much as the multiply itself. Packing once at load time measured, on the
benchmark machine (docs/benchmarks.md), a decode step at batch 16 going from 61.5 to
47.4 ms and batch 1 from 38.0 to 22.4 ms. The results are bit-identical to
``F.linear`` (same oneDNN kernels, same accumulation order), which
tests/models/test_packed_linear.py checks.

Only bf16 weights on CPU are packed. Float32 is left on ``F.linear`` (MKL): the packed
fp32 path is faster too but not bit-identical, and fp32 is our reference dtype.
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(weight: torch.Tensor) -> bool:
    """Whether this weight would be served by a prepacked oneDNN matmul here."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's blocked layout (an opaque tensor).

    The packed weight is a buffer, not a parameter: it is derived from the checkpoint
    and never trained or reloaded; build a new model to load new weights.
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


def pack_linear_layers(model: nn.Module) -> int:
    """Swap every packable ``nn.Linear`` in ``model`` for a PackedLinear, in place.

    Returns how many were packed (0 where the dtype or device does not qualify).
    """
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children()
             if isinstance(child, nn.Linear) and can_pack(child.weight)]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child.weight, child.bias))
    return len(swaps)
