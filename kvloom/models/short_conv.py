"""LiquidAI LFM2's gated short convolution (``Lfm2ShortConv`` in transformers 5.25's
modeling_lfm2.py, the reference): in_proj to B, C and x (in that order along the
features), B * x convolved causally per channel over its last ``conv_kernel`` values
(no activation), times C, out_proj. Its state per request is the convolution's last
``conv_kernel - 1`` inputs, ``conv_state`` [slots, conv_kernel - 1, hidden] in the model's
dtype, in the state slots as a Mamba2 mixer's (``SlotStateLayer``). On a CPU everything
between the projections is one C++ call (``ssm_ops.short_conv_native``: the products
rounded as torch rounds them, the convolution causal_conv's); ``kernel = "reference"`` runs
the torch ops (the convolution through models/ssm_ops.causal_conv)."""

from __future__ import annotations

import torch
from torch import nn

from kvloom.model_families import ShortConvConfig
from kvloom.models import ssm_ops
from kvloom.models.mamba2 import SlotStateLayer


class ShortConv(SlotStateLayer):
    def __init__(self, hidden_size: int, config: ShortConvConfig) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=config.bias)
        self.conv = nn.Conv1d(hidden_size, hidden_size, config.conv_kernel, groups=hidden_size, bias=config.bias)
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=config.bias)
        self.conv_state = torch.empty(0)
        # The convolution's float32 parameters, made once by pack (after the weights load).
        self.packed_conv: ssm_ops.ConvParams | None = None
        self.kernel = "native"  # or "reference": the torch ops

    def pack(self, matmul: str) -> int:
        """Make the convolution's float32 parameters once. Packs no matmul: in_proj and
        out_proj are nn.Linear layers, packed as every other."""
        self.packed_conv = ssm_ops.ConvParams.of(self.conv)
        return 0

    def allocate_state(self, num_slots: int, device: torch.device, dtype: torch.dtype) -> int:
        self.conv_state = torch.zeros(num_slots, self.conv.kernel_size[0] - 1, self.hidden_size, dtype=dtype,
                                      device=device)
        return self.conv_state.numel() * self.conv_state.element_size()

    def copy_state(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.conv_state.index_copy_(0, dst, self.conv_state[src])

    @property
    def state_device(self) -> torch.device:
        return self.conv_state.device

    def forward(self, hidden: torch.Tensor, spans: ssm_ops.SSMSpans) -> torch.Tensor:
        """[tokens, hidden] -> [tokens, hidden]; reads and writes the requests' slots."""
        if not self.conv_state.numel():
            raise RuntimeError("a short convolution runs only after allocate_state gave it its state slots")
        proj = self.in_proj(hidden)
        conv = self.packed_conv if self.packed_conv is not None else ssm_ops.ConvParams.of(self.conv)
        if self.kernel == "native" and ssm_ops.native_conv_applies(proj, self.conv_state, conv):
            native: torch.Tensor = self.out_proj(ssm_ops.short_conv_native(proj, conv, self.conv_state, spans))
            return native
        B, C, x = proj.chunk(3, dim=-1)
        mixed = ssm_ops.causal_conv(B * x, conv, self.conv_state, spans)
        out: torch.Tensor = self.out_proj(C * mixed)
        return out
