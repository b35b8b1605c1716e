"""Tensor parallel on CUDA (nccl for the steps, gloo for the control messages): greedy
tokens are transformers' own. Runs where two GPUs are visible (the CPU suite's
gloo and shared-memory tests cover the same code paths on the host)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers_models import hf_greedy_with_cache, write_tiny_hf_model

from kvloom import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices")


def test_tp2_on_cuda_is_transformers(tmp_path: Path) -> None:
    import transformers

    path = write_tiny_hf_model(tmp_path / "tiny", seed=7)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[5, 6, 7, 8, 9] * 4, list(range(20, 70))]
    expected = [hf_greedy_with_cache(reference, prompt, 16) for prompt in prompts]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(str(path), tensor_parallel_size=2, device="cuda", dtype="float32", num_blocks=64) as llm:
        assert llm.engine.first_rank.group.shm is None  # nccl carries the steps
        assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)] == expected
