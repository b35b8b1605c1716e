"""The KV cache tensors: one preallocated pool for all layers.

Layout: [layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]. A block id
indexes the same slot range in every layer, so one block table serves the whole model.
"""

from __future__ import annotations

import torch

from kvloom.config import CacheConfig, ModelConfig

GIB = 1 << 30


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return model.num_layers * 2 * block_size * model.num_kv_heads * model.head_dim * element


def num_blocks_for(cache: CacheConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    """``num_blocks`` if given, else as many blocks as ``kv_cache_memory`` GiB holds."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    count = int(cache.kv_cache_memory * GIB) // bytes_per_block(model, cache.block_size, dtype)
    if count < 1:
        raise ValueError(f"kv_cache_memory={cache.kv_cache_memory} GiB holds no KV block of "
                         f"{cache.block_size} tokens for this model")
    return count


def allocate_kv_pool(model: ModelConfig, num_blocks: int, block_size: int,
                     dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Zero-filled so that padded/unused slots never hold NaNs that a kernel could read.
    return torch.zeros(model.num_layers, 2, num_blocks, block_size, model.num_kv_heads,
                       model.head_dim, dtype=dtype, device=device)
