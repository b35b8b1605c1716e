"""The adapters' table for the native decoder walk (kvloom/models/decoder_stack.py):
each layer's four LoRA projections' packed shrink and expand weights per slot, as
pointers the walk reads, so that steps with adapter rows run in one native call as
base-model steps do. Built again after every load (a slot's kernels are new tensors)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvloom.kernels.decoder_stack import LORA_PROJECTIONS, StackLoRA
from kvloom.lora.layers import LoRALinear
from kvloom.models.packed_linear import InvariantLinear


def stack_table(layers: Sequence[Sequence[LoRALinear | None]], max_loras: int, isa: str) -> StackLoRA | None:
    """The table for ``layers`` (each a layer's qkv, o, gate_up and down LoRALinear, in
    LORA_PROJECTIONS order; None for one no adapter can target, whose row stays 0), or None
    where a loaded slot's matmuls are not kvloom's GEMM on the walk's path ``isa`` (those
    steps then take the module path)."""
    pointers = torch.zeros(len(layers), len(LORA_PROJECTIONS), max_loras, 2, dtype=torch.int64)
    owners: list[torch.Tensor] = []
    for index, projections in enumerate(layers):
        assert len(projections) == len(LORA_PROJECTIONS)
        for column, projection in enumerate(projections):
            for slot, kernels in enumerate(() if projection is None else projection.kernels):
                if kernels is None:  # an empty slot, or one whose adapter leaves this projection alone
                    continue
                if not all(isinstance(kernel, InvariantLinear) and kernel.isa == isa for kernel in kernels):
                    return None
                shrink, expand = kernels
                assert isinstance(shrink, InvariantLinear) and isinstance(expand, InvariantLinear)
                pointers[index, column, slot, 0] = shrink.packed_weight.data_ptr()
                pointers[index, column, slot, 1] = expand.packed_weight.data_ptr()
                owners += [shrink.packed_weight, expand.packed_weight]
    # Each projection's shrink width: its parts x the largest rank, the same in every layer that has
    # it (a mixture-of-experts model's first layer may have no MLP projection: the widest, then).
    widths = torch.tensor([max((layer[column].a.shape[1] for layer in layers  # type: ignore[union-attr]
                                if layer[column] is not None), default=0)
                           for column in range(len(LORA_PROJECTIONS))], dtype=torch.int64)
    return StackLoRA(pointers, widths, tuple(owners))
