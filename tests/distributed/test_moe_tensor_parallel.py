"""Mixture-of-experts models under tensor parallel on CPU (rank processes spawned by
the engine): each rank holds its share of every expert's features (and the shared
expert's), the router is replicated, one all-reduce per FFN; the greedy tokens are one
process's through chunked prefill and preemption.

Only one process group exists per process, so each engine is shut down (``with
LLM(...)``) before the next one starts.
"""

from __future__ import annotations

import pytest
from helpers_models import write_tiny_hf_model

from kvloom import LLM, SamplingParams

ENGINE = dict(dtype="float32", device="cpu", num_blocks=14, block_size=16, max_num_batched_tokens=24)
PROMPTS = [[(13 * i + 5 * j) % 500 + 5 for j in range(n)] for i, n in enumerate([1, 9, 30, 45, 60])]


@pytest.mark.parametrize("arch, overrides", [
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)),
    ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, norm_topk_prob=True)),
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)),
])
def test_tp2_greedy_tokens_are_one_processs(arch: str, overrides: dict[str, object], tmp_path) -> None:
    path = write_tiny_hf_model(tmp_path / arch, arch=arch, seed=5, **overrides)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(path), **ENGINE) as single:
        expected = [list(o.outputs[0].token_ids) for o in single.generate(PROMPTS, params)]
    with LLM(str(path), tensor_parallel_size=2, **ENGINE) as llm:
        assert [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)] == expected
        assert llm.engine.stats().num_preemptions > 0
        llm.engine.check_integrity()
