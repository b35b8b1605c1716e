"""KV pool sizing: num_blocks, kv_cache_memory GiB, or gpu_memory_utilization of the
device's memory (injected here as DeviceMemory, so no test depends on this machine)."""

from __future__ import annotations

import pytest
import torch

from kvloom.config import CacheConfig, EngineConfig, ModelConfig
from kvloom.runner.kv_pool import GIB, DeviceMemory, bytes_per_block, device_memory, num_blocks_for

# 2 layers x (K, V) x 16 tokens x 2 kv heads x 8 dims x 4 bytes = 4096 bytes a block.
MODEL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=16,
                    intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=8)
BLOCK = 2 * 2 * 16 * 2 * 8 * 4


def test_block_bytes_by_hand() -> None:
    assert bytes_per_block(MODEL, 16, torch.float32) == BLOCK == 4096


def test_default_and_explicit_gib() -> None:
    assert num_blocks_for(CacheConfig(), MODEL, torch.float32) == GIB // BLOCK  # 1 GiB default
    assert num_blocks_for(CacheConfig(kv_cache_memory=0.5), MODEL, torch.float32) == GIB // 2 // BLOCK


def test_gpu_memory_utilization_is_a_share_of_total_less_what_is_held() -> None:
    memory = DeviceMemory(total=100 * BLOCK, free=90 * BLOCK, held=10 * BLOCK)
    # 0.5 of 100 blocks' worth, less the 10 the weights hold: 40 blocks.
    assert num_blocks_for(CacheConfig(gpu_memory_utilization=0.5), MODEL, torch.float32, memory) == 40
    # Never more than is free: 0.95 x 100 - 10 = 85, but only 60 are free.
    tight = DeviceMemory(total=100 * BLOCK, free=60 * BLOCK, held=10 * BLOCK)
    assert num_blocks_for(CacheConfig(gpu_memory_utilization=0.95), MODEL, torch.float32, tight) == 60


def test_gpu_memory_utilization_on_cpu_is_a_share_of_the_free_ram() -> None:
    memory = device_memory(torch.device("cpu"))
    assert memory.total == memory.free > 0 and memory.held == 0
    free_ram = DeviceMemory(total=64 * BLOCK, free=64 * BLOCK)
    assert num_blocks_for(CacheConfig(gpu_memory_utilization=0.25), MODEL, torch.float32, free_ram) == 16


def test_num_blocks_still_wins() -> None:
    assert num_blocks_for(CacheConfig(num_blocks=7, gpu_memory_utilization=0.5), MODEL, torch.float32) == 7


def test_nothing_left_is_a_clear_error() -> None:
    memory = DeviceMemory(total=100 * BLOCK, free=50 * BLOCK, held=60 * BLOCK)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.5 leaves no memory for the KV pool"):
        num_blocks_for(CacheConfig(gpu_memory_utilization=0.5), MODEL, torch.float32, memory)
    small = DeviceMemory(total=BLOCK, free=BLOCK)
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.5 holds no KV block of 16 tokens"):
        num_blocks_for(CacheConfig(gpu_memory_utilization=0.5), MODEL, torch.float32, small)


@pytest.mark.parametrize("value", [0, 1.5, -0.1])
def test_utilization_out_of_range_names_the_field(value: float) -> None:
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        CacheConfig(gpu_memory_utilization=value)


def test_both_sizes_conflict_clearly() -> None:
    with pytest.raises(ValueError, match="kv_cache_memory and gpu_memory_utilization both size the "
                                         "KV pool: give one"):
        EngineConfig.from_kwargs("m", kv_cache_memory=2.0, gpu_memory_utilization=0.9)


def test_the_engine_sizes_its_pool_from_the_share(tiny_llama, monkeypatch) -> None:
    import kvloom.runner.tensor_parallel as loading
    from kvloom.engine.engine import LLMEngine

    mc = ModelConfig.from_hf(__import__("json").loads((tiny_llama / "config.json").read_text()))
    block = bytes_per_block(mc, 16, torch.float32)
    monkeypatch.setattr(loading, "device_memory",
                        lambda device: DeviceMemory(total=40 * block, free=40 * block))
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_llama), dtype="float32",
                                                gpu_memory_utilization=0.5))
    assert engine.num_blocks == 20


def test_the_cpu_pool_is_zero_filled_shaped_and_on_huge_page_boundaries():
    import torch

    from kvloom.kernels.huge_pages import HUGE_PAGE
    from kvloom.runner.kv_pool import allocate_kv_pool

    class Model:  # the two fields allocate_kv_pool reads
        num_kv_layers = 2
        kv_entry = (2, 3, 64)

    pool = allocate_kv_pool(Model(), num_blocks=1200, block_size=16, dtype=torch.bfloat16,
                            device=torch.device("cpu"))
    assert pool.shape == (2, 2, 1200, 16, 3, 64) and pool.is_contiguous()
    assert not pool.any()
    assert pool.data_ptr() % HUGE_PAGE == 0  # so every page of it can be a huge one
