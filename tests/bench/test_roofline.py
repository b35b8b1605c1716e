"""`kvloom bench roofline`'s arithmetic: the decode-step bound from hand-computed bytes
and FLOPs, and the bf16 rate it takes (the better of torch's and kvloom's GEMM)."""

from __future__ import annotations

import pytest
import torch

from kvloom.bench import roofline
from kvloom.config import ModelConfig
from kvloom.kernels import gemm

MODEL = ModelConfig("LlamaForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16)


def test_the_bound_is_weights_and_kv_read_once_or_the_flops_at_the_rate() -> None:
    # 1,000,000 bf16 parameters, 8 sequences of 100 tokens: KV 8 x 100 x 2 layers x (K, V) x 2 heads x 16 x 2 B.
    bound = roofline.decode_step_bound(MODEL, 1_000_000, batch=8, context=100, dtype=torch.bfloat16,
                                       bandwidth_gbs=10.0, gflops=1.0)
    assert bound.weight_bytes == 2_000_000
    assert bound.kv_bytes == 8 * 100 * 2 * 2 * 2 * 16 * 2 == 204_800
    attention = 8 * 100 * 2 * 4 * 16 * 4  # QK^T and PV: 2 FLOPs each per key, head and dim
    assert bound.flops == 2 * 1_000_000 * 8 + attention
    assert bound.memory_seconds == pytest.approx(2_204_800 / 10e9)
    assert bound.compute_seconds == pytest.approx(bound.flops / 1e9)
    assert bound.seconds == max(bound.memory_seconds, bound.compute_seconds)


@pytest.mark.skipif(gemm.default_isa() is None, reason="kvloom's GEMM does not run here")
def test_kvloom_gemm_rate_is_measured_on_the_engines_path() -> None:
    assert roofline.kvloom_gemm_gflops(4, 64, 96) > 0
