"""Decode steps replayed from per-bucket static buffers (runner/cuda_graphs.py), on CPU:
the graphs' capture is swapped for ``EagerCapture`` (the same function on the same
static buffers, not recorded), so what is tested is everything but the recording: the
copy into the bucket, the padding rows on the scratch block, the split-K shape fixed for
the longest context. Greedy tokens equal the eager reference's, with 3 decodes in a
bucket of 4 (one padding row) and then fewer; the scratch block is never handed out."""

from __future__ import annotations

import pytest
import torch

from kvloom import LLM, SamplingParams

pytest.importorskip("triton", reason="the CUDA backend's kernels need the triton package (pip install triton)")


def test_triton_decode_graph_buckets_give_the_eager_tokens(tiny_llama, monkeypatch) -> None:
    from kvloom.runner import cuda_graphs

    prompts = [[5, 9, 14, 3, 77, 21, 8, 40, 2, 31, 60, 11, 7, 19, 23, 42, 5, 6], [12, 13], [99, 98, 97, 96, 95],
               [7, 7, 8]]
    # Requests finish at different steps: 4 decodes, then 3 in the bucket of 4 (its padding
    # row last held a live request's slot), then 2, then 1.
    lengths = [6, 3, 5, 8]
    reference = LLM(str(tiny_llama), dtype="float32", attention_backend="torch_ref", num_blocks=32, block_size=16,
                    device="cpu")
    expected = [reference.generate([p], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
                .outputs[0].token_ids for p, n in zip(prompts, lengths, strict=True)]

    monkeypatch.setattr(cuda_graphs, "graph_refusal", lambda *args: None)
    monkeypatch.setattr(cuda_graphs, "CUDACapture", cuda_graphs.EagerCapture)
    llm = LLM(str(tiny_llama), dtype="float32", attention_backend="triton", num_blocks=32, block_size=16,
              max_num_seqs=4, device="cpu")
    engine = llm.engine
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4]
    assert engine.kv_manager.pool.num_blocks == 31 and graphs.scratch_slot == 31 * 16  # the last block: scratch
    replays: list[int] = []
    for size, bucket in graphs.buckets.items():
        def counted(replay=bucket.replay, size=size) -> torch.Tensor:
            replays.append(size)
            return replay()
        bucket.replay = counted
    for prompt, n in zip(prompts, lengths, strict=True):
        engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output.outputs[0].token_ids
        engine.check_integrity()
    assert [finals[str(i)] for i in range(4)] == expected
    assert {4, 2, 1} <= set(replays)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="records real CUDA graphs: GPU only (scripts/gpu_check.sh)")
def test_triton_cuda_graphs_give_the_eager_tokens(tiny_llama) -> None:
    prompts = [[5, 9, 14, 3, 77, 21, 8, 40], [12, 13], [99, 98, 97, 96, 95], [7, 7, 8]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 3, 5, 8)]
    tokens = {}
    for eager in (True, False):
        llm = LLM(str(tiny_llama), dtype="float32", num_blocks=32, block_size=16, max_num_seqs=4, enforce_eager=eager)
        assert (llm.engine.runner.graphs is None) == eager
        tokens[eager] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert tokens[False] == tokens[True]
