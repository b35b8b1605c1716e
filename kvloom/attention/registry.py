"""Attention backends by name, each imported only when chosen (so that a CUDA-only
kernel never loads on a CPU machine)."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from typing import Any

import torch

from kvloom.attention.base import AttentionBackend
from kvloom.config import ModelConfig

logger = logging.getLogger(__name__)

# name -> "module:Class"; imported only when chosen.
BACKENDS: dict[str, str] = {
    "torch_ref": "kvloom.attention.torch_ref:TorchReferenceBackend",
    "cpu_paged": "kvloom.attention.cpu_paged:CPUPagedBackend",
    "triton": "kvloom.attention.triton_paged:TritonPagedBackend",
    # Optional CUDA libraries, used when installed and named (never chosen by "auto").
    "flashinfer": "kvloom.attention.flashinfer_paged:FlashInferBackend",
    "flash_attn": "kvloom.attention.flash_attn_paged:FlashAttnBackend",
}
CUDA_ONLY = frozenset({"flashinfer", "flash_attn"})  # their kernels exist only for CUDA tensors
# Latent attention (MLA models) is served by these alone; "auto" picks the C++ kernel on a
# CPU where it builds, else the batched reference.
MLA_BACKENDS: dict[str, str] = {
    "mla_cpu": "kvloom.attention.mla_cpu:MLACPUBackend",
    "mla_batched": "kvloom.attention.mla_ref:MLABatchedBackend",
    "mla_ref": "kvloom.attention.mla_ref:MLAReferenceBackend",
}


def resolve_backend_name(name: str, device: torch.device) -> str:
    """"auto": the C++ paged kernel on CPU when it builds here, the Triton kernels on
    CUDA when triton is installed, else the reference."""
    if name != "auto":
        return name
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is not None:
            return "triton"
        logger.warning("triton is not installed; using the pure-PyTorch attention backend on CUDA")
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
    if name in CUDA_ONLY and device.type != "cuda":
        raise ValueError(f"attention_backend {name!r} runs on CUDA only, not {device.type}; on {device.type} "
                         f"use auto, cpu_paged or torch_ref")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention_backend 'triton' runs on CUDA (on {device.type} only under Triton's "
                         "interpreter, TRITON_INTERPRET=1, for tests); on the CPU use auto, cpu_paged or torch_ref")
    module_name, class_name = BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    backend: AttentionBackend[Any] = cls(num_heads, num_kv_heads, head_dim)
    return backend


def backend_for(model: ModelConfig, name: str, device: torch.device) -> AttentionBackend[Any]:
    """The backend of ``model``'s attention over its pool (``model``: this rank's view):
    the named one, or for latent attention one of MLA_BACKENDS."""
    mla = model.mla
    if mla is None:
        if name in MLA_BACKENDS:
            raise ValueError(f"attention_backend {name!r} serves latent attention (DeepSeek) only, not "
                             f"{model.architecture}; use one of {sorted(BACKENDS) + ['auto']}")
        backend = make_backend(name, device, model.num_heads, model.num_kv_heads, model.head_dim)
        if model.attention_sinks and not backend.supports_sinks:
            raise ValueError(f"attention_backend {backend.name!r} has no attention sinks, which "
                             f"{model.architecture}'s layers have; use auto, cpu_paged, triton or torch_ref")
        if model.scales is not None and model.scales.attention is not None:
            backend.scale = model.scales.attention  # Granite's attention_multiplier, Gemma's query_pre_attn_scalar
        if model.gemma is not None and model.gemma.attention_softcap is not None:
            backend.softcap = model.gemma.attention_softcap  # Gemma 2's
        return backend
    if name == "auto":
        name = "mla_cpu" if device.type == "cpu" and _latent_kernel_builds() else "mla_batched"
    if name not in MLA_BACKENDS:
        raise ValueError(f"attention_backend {name!r} does not serve latent attention ({model.architecture}); "
                         f"use one of {sorted(MLA_BACKENDS) + ['auto']}")
    if name == "mla_cpu" and device.type != "cpu":
        raise ValueError(f"attention_backend 'mla_cpu' runs on the CPU only, not {device.type}; "
                         "use auto or mla_batched")
    module_name, class_name = MLA_BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    latent: AttentionBackend[Any] = cls(model.num_heads, mla.latent_dim, mla.kv_lora_rank, mla.softmax_scale)
    return latent


def _latent_kernel_builds() -> bool:
    from kvloom.kernels import latent_attention
    available = latent_attention.available()
    if not available:
        logger.warning("kvloom/csrc/latent_attention.cpp could not be built; latent attention runs in PyTorch")
    return available
