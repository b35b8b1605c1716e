"""A mixture-of-experts layer's routed experts held in MXFP4 (GPT-OSS's hub checkpoints):
4.25 bits a weight instead of 16, which is what lets gpt-oss-20b's 21B parameters fit a
24 GiB machine (its experts are 19B of them).

``MXFP4Experts`` holds every local expert's two matmuls as the checkpoint stores them,
``*_blocks`` [experts, out, in / 32, 16] (two e2m1 codes a byte) and ``*_scales``
[experts, out, in / 32] (an e8m0 power of two per 32 inputs), in kvloom's experts layout
(gate_up's rows gate | up, down [hidden, inter]). ``layers()`` gives each expert's pair as
``kernels.mxfp4.MXFP4Linear`` modules, which dequantize as they multiply (the CPU kernel);
``dequantized()`` the dense tensors (the reference path, and the fallback where the kernel
does not run).
"""

from __future__ import annotations

import torch
from torch import nn

from kvloom.kernels import mxfp4

GROUP = 32  # inputs sharing a scale


class MXFP4Experts(nn.Module):
    """``experts`` experts of gate_up [2 x inter, hidden] and down [hidden, inter], 4-bit.
    The parameters are uint8 (no gradient, untouched by ``.to(dtype)``)."""

    def __init__(self, experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        for name, size in (("hidden_size", hidden), ("intermediate size (this rank's)", inter)):
            if size % GROUP:
                raise ValueError(f"MXFP4 experts need each matmul's inputs in groups of {GROUP}; the {name} is {size}")

        def zeros(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=torch.uint8), requires_grad=False)

        self.gate_up_blocks = zeros(experts, 2 * inter, hidden // GROUP, GROUP // 2)
        self.gate_up_scales = zeros(experts, 2 * inter, hidden // GROUP)
        self.down_blocks = zeros(experts, hidden, inter // GROUP, GROUP // 2)
        self.down_scales = zeros(experts, hidden, inter // GROUP)

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2 x inter, hidden], down [E, hidden, inter]) of ``dtype`` (exact in
        float32 and bf16: every MXFP4 number is a bf16 one)."""
        return (mxfp4.dequantize_mxfp4(self.gate_up_blocks, self.gate_up_scales, dtype),
                mxfp4.dequantize_mxfp4(self.down_blocks, self.down_scales, dtype))

    def layers(self) -> list[tuple[nn.Module, nn.Module]]:
        """Each expert's (gate_up, down) as the kernel's modules, views of these tensors."""
        return [(mxfp4.MXFP4Linear(self.gate_up_blocks[e], self.gate_up_scales[e]),
                 mxfp4.MXFP4Linear(self.down_blocks[e], self.down_scales[e]))
                for e in range(self.gate_up_blocks.shape[0])]

    def runs_here(self) -> bool:
        """Whether the kernel runs these experts: on a CPU where it builds."""
        return self.gate_up_blocks.device.type == "cpu" and mxfp4.available()
