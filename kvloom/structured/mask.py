"""The grammar's verdict on the next token, as the sampler takes it (no llguidance import)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class GrammarMask:
    """Allowed next tokens of the C rows under a grammar (structured output)."""

    rows: torch.Tensor  # [C] int64 batch rows
    # [C, ceil(V / 32)] int32 on the logits' device; bit b of word w allows token 32 * w + b.
    bitmask: torch.Tensor
