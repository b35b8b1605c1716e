"""Attention backends by name, each imported only when chosen (so that a CUDA-only
kernel never loads on a CPU machine)."""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

from kvloom.attention.base import AttentionBackend

logger = logging.getLogger(__name__)

# name -> "module:Class"; imported only when chosen.
BACKENDS: dict[str, str] = {
    "torch_ref": "kvloom.attention.torch_ref:TorchReferenceBackend",
    "cpu_paged": "kvloom.attention.cpu_paged:CPUPagedBackend",
}


def resolve_backend_name(name: str, device: torch.device) -> str:
    """"auto": the C++ paged kernel on CPU when it builds here, else the reference."""
    if name != "auto":
        return name
    if device.type == "cpu":
        from kvloom.attention.cpu_paged import KernelUnavailable, load_library
        try:
            load_library()
            return "cpu_paged"
        except KernelUnavailable as error:
            logger.warning("%s; using the pure-PyTorch attention backend", error)
    return "torch_ref"


def make_backend(name: str, device: torch.device, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> AttentionBackend[Any]:
    name = resolve_backend_name(name, device)
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {sorted(BACKENDS) + ['auto']}, got {name!r}")
    module_name, class_name = BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(num_heads, num_kv_heads, head_dim)
