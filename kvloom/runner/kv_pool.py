"""The KV cache tensors: one preallocated pool for all layers.

Layout: [layers, planes, num_blocks, block_size, heads, dim], where (planes, heads,
dim) is ``ModelConfig.kv_entry``: (2 (K, V), kv_heads, head_dim) for multi-head and
grouped-query attention, (1, 1, latent) for DeepSeek's latent attention. A block id
indexes the same slot range in every layer, so one block table serves the whole model.
The layers are those with KV (``ModelConfig.num_kv_layers``): a hybrid's attention
layers only, none for a pure state-space model (its blocks are then bookkeeping).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvloom.config import DEFAULT_KV_CACHE_MEMORY, CacheConfig, ModelConfig
from kvloom.kernels.huge_pages import empty_on_huge_pages

GIB = 1 << 30


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes of the device's memory: ``total``, ``free`` now, and ``held`` by this
    process already (the weights), which ``gpu_memory_utilization`` counts in its share."""

    total: int
    free: int
    held: int = 0


def device_memory(device: torch.device) -> DeviceMemory:
    """CUDA: the device's total and free memory, and what torch has reserved here.
    CPU: the RAM available now (``MemAvailable``, else the free pages) as both total
    and free: ``gpu_memory_utilization`` is a share of it."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(total, free, torch.cuda.memory_reserved(device))
    available = _available_ram()
    return DeviceMemory(available, available)


def _available_ram() -> int:
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_pool_bytes(cache: CacheConfig, memory: DeviceMemory | None) -> int:
    """Bytes for the pool: ``kv_cache_memory`` GiB; or ``gpu_memory_utilization`` of the
    total less what this process holds, at most what is free (``memory`` is needed
    then); or ``DEFAULT_KV_CACHE_MEMORY`` GiB."""
    if cache.gpu_memory_utilization is None:
        return int((cache.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY) * GIB)
    if memory is None:
        raise ValueError("gpu_memory_utilization needs the device's memory")
    budget = min(int(cache.gpu_memory_utilization * memory.total) - memory.held, memory.free)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={cache.gpu_memory_utilization} leaves no memory "
                         f"for the KV pool: {memory.held / GIB:.2f} GiB already held of "
                         f"{memory.total / GIB:.2f} GiB ({memory.free / GIB:.2f} GiB free)")
    return budget


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    planes, heads, dim = model.kv_entry
    return model.num_kv_layers * planes * block_size * heads * dim * element


def num_blocks_for(cache: CacheConfig, model: ModelConfig, dtype: torch.dtype,
                   memory: DeviceMemory | None = None) -> int:
    """``num_blocks`` if given, else as many blocks as ``kv_pool_bytes`` holds."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    count = kv_pool_bytes(cache, memory) // bytes_per_block(model, cache.block_size, dtype)
    if count < 1:
        sizing = (f"gpu_memory_utilization={cache.gpu_memory_utilization}"
                  if cache.gpu_memory_utilization is not None
                  else f"kv_cache_memory={cache.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY} GiB")
        raise ValueError(f"{sizing} holds no KV block of {cache.block_size} tokens for this model")
    return count


def allocate_kv_pool(model: ModelConfig, num_blocks: int, block_size: int,
                     dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Zero-filled so that padded/unused slots never hold NaNs that a kernel could read.
    planes, heads, dim = model.kv_entry
    shape = (model.num_kv_layers, planes, num_blocks, block_size, heads, dim)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # Decode attention reads the blocks in a scattered order: a TLB miss per 4 KiB page
    # otherwise (kernels/huge_pages.py). The zero fill is the first touch.
    return empty_on_huge_pages(math.prod(shape), dtype).view(shape).zero_()


def copy_blocks(kv_caches: torch.Tensor, copies: torch.Tensor) -> None:
    """Copy whole blocks in every layer and plane: ``copies`` is [2, n] int64, source
    blocks then destinations (``ForwardBatch.block_copies``). The sources are read
    before anything is written, so a block may be both (never the case today: a
    destination is a newly allocated block, a source a cached one)."""
    kv_caches.index_copy_(2, copies[1], kv_caches.index_select(2, copies[0]))
