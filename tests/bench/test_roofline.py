"""`kvloom bench roofline`'s arithmetic: the decode-step bound from hand-computed bytes
and FLOPs, the bf16 rate it takes (the better of torch's and kvloom's GEMM), and the
engine's decode steps timed at the bound's context."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest
import torch

from kvloom.bench import roofline, steps
from kvloom.bench.steps import StepTiming
from kvloom.config import EngineConfig, ModelConfig
from kvloom.engine.engine import LLMEngine
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


def test_centred_prompts_put_the_timed_steps_mean_context_on_the_bounds() -> None:
    # Decode step j of a prompt of P tokens reads P + j keys: steps 1..40 read P + 20.5 on
    # average, so a context of 300 wants P = 280.
    assert steps.centred_prompt(300, 40) == 280
    # 64 prompts of 280 fill ceil(17,920 / 2,048) = 9 prefill steps, and the sequences
    # prefilled first decode during the later ones: about 9 // 2 = 4 steps ahead on average.
    assert steps.centred_prompt(300, 40, batch=64, step_tokens=2048) == 276
    with pytest.raises(ValueError, match="cannot centre on a context of 10 tokens"):
        steps.centred_prompt(10, 40)


def test_the_engines_centred_decode_steps_read_the_context_on_average(tiny_llama: Path) -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_llama), num_blocks=256, block_size=16,
                                                max_num_batched_tokens=128, enable_prefix_caching=False))
    timing = steps.time_decode(engine, batch=8, context=60, steps=10, seed=0, centred=True)
    # 8 prompts of 60 - 5 - 2 = 53 tokens (4 prefill steps of 128): every timed step adds
    # one key to each sequence, and the ten steps read 60 keys on average, give or take
    # the prefill steps' lead.
    assert len(timing.milliseconds) == len(timing.kv_tokens) == 10
    assert [b - a for a, b in itertools.pairwise(timing.kv_tokens)] == [1.0] * 9
    assert abs(statistics.fmean(timing.kv_tokens) - 60) <= 1.0
    plain = steps.time_decode(engine, batch=8, context=60, steps=10, seed=0)  # prompts of 60
    assert statistics.fmean(plain.kv_tokens) >= 60 + 5.5
    engine.shutdown()


def test_measured_steps_are_printed_against_their_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(roofline, "matmul_gflops", lambda m, k, n, dtype: 100.0)
    monkeypatch.setattr(roofline, "kvloom_gemm_gflops", lambda m, k, n: None)
    monkeypatch.setattr(roofline, "memory_bandwidth_gbs", lambda: 10.0)
    timing = StepTiming("decode b8 x 100", milliseconds=[3.0, 4.0, 5.0], kv_tokens=[99.0, 100.0, 101.0])
    text = roofline.run_roofline(MODEL, 1_000_000, [8], 100, {8: timing})
    # The bound of the first test at 10 GB/s and 100 GFLOP/s: (2,000,000 + 204,800) B / 10 GB/s
    # = 0.22048 ms of memory against 16,409,600 FLOP / 100 GFLOP/s = 0.164 ms.
    assert text.splitlines()[-1].split() == ["8", "3", "100.0", "4.00", "0.22", f"{4.0 / 0.22048:.2f}x"]
