"""The CUDA backend's Triton kernels (kvloom/kernels/triton_attention.py) against the
pure-PyTorch reference: paged attention over mixed batches (decodes, fresh prefills,
chunks after a cached prefix, split-K decode steps), block sizes 16 and 32, GQA, and
the KV write, slot for slot. Without a GPU they run in Triton's interpreter on CPU
(tests/conftest.py sets TRITON_INTERPRET=1); ``pytest -k triton`` selects them."""

from __future__ import annotations

import pytest
import torch
from helpers_attention import batches_with_blocks_let_go, mixed_batch

from kvloom.attention.base import write_token_major
from kvloom.attention.registry import make_backend
from kvloom.batch import ForwardBatch

pytest.importorskip("triton", reason="the CUDA backend's kernels need the triton package (pip install triton)")

from kvloom.attention.triton_paged import split_shape  # noqa: E402 - after the skip: it imports triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# (tokens already computed, tokens this step): decodes at short and long contexts,
# fresh prefills, a chunk after a cached prefix, one longer than a tile.
MIXED = [(0, 1), (0, 7), (5, 1), (16, 16), (33, 9), (70, 1), (2, 30), (40, 3)]
DECODES = [(0, 1), (3, 1), (47, 1), (200, 1), (520, 1)]  # a decode-only step: split-K
# The interpreter multiplies bf16 tiles in float32 (triton_attention.interpreting), so on a CPU
# a bf16 case adds only the casts, which the reference test above checks: the split-K and
# invariance cases take both dtypes on a GPU (tensor cores), float32 alone in the interpreter.
KERNEL_DTYPES = [torch.float32, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32]


def run_both(shapes, dtype, heads, kv_heads, head_dim, block_size, window=0, softcap=0.0):
    """(triton's output, torch_ref's, the two pools' slots) for one batch over the same history."""
    torch.manual_seed(0)
    num_blocks = 80
    batch = ForwardBatch.build(mixed_batch(block_size, num_blocks, seed=block_size + heads, shapes=shapes),
                               block_size, DEVICE)
    tokens = batch.num_tokens
    q, k, v = (torch.randn(tokens, n, head_dim, dtype=dtype, device=DEVICE) for n in (heads, kv_heads, kv_heads))
    history = [torch.randn(num_blocks * block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
               for _ in range(2)]
    slots = torch.arange(num_blocks * block_size, device=DEVICE)
    outputs, pools = [], []
    for name in ("triton", "torch_ref"):
        backend = make_backend(name, DEVICE, heads, kv_heads, head_dim)
        backend.softcap = softcap
        cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
        write_token_major(cache, *history, slots)  # the same history in both (the layout they share)
        outputs.append(backend.forward(q, k, v, cache, batch, backend.prepare(batch), window))
        pools.append(cache)
    return outputs, pools


# The interpreter is slow (about a second a case): each head layout with its block size.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),  # SmolLM2's GQA
    (6, 2, 32, 32),
    (4, 4, 16, 16),  # no sharing: one query head per KV head
])
def test_triton_paged_attention_matches_reference(dtype, heads, kv_heads, head_dim, block_size) -> None:
    (actual, expected), (pool_triton, pool_ref) = run_both(MIXED, dtype, heads, kv_heads, head_dim, block_size)
    assert torch.equal(pool_triton, pool_ref)  # the step's KV write put every token in the same slot
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_split_k_decode_matches_reference(dtype, block_size) -> None:
    # The longest request holds 33 (or 17) blocks: 4 (or 2) splits, short requests' later splits empty.
    assert split_shape(-(-521 // block_size))[0] == (4 if block_size == 16 else 2)
    (actual, expected), _ = run_both(DECODES, dtype, 8, 2, 32, block_size)
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("shapes,softcap", [(MIXED, 0.3), (DECODES, 0.0)], ids=["mixed-softcap", "split-k decodes"])
def test_triton_sliding_window_and_softcap_match_reference(shapes, softcap) -> None:
    """A window of 21 keys: prefill tiles whose rows start at different keys (with Gemma
    2's logit softcapping, a cap of 0.3 that bends every score), and split-K decodes whose
    first splits lie wholly before the window (empty, weight 0)."""
    (actual, expected), _ = run_both(shapes, torch.float32, 9, 3, 64, 16, window=21, softcap=softcap)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("shapes", [MIXED, DECODES], ids=["mixed", "split-k decodes"])
def test_triton_never_reads_blocks_let_go_behind_the_window(shapes) -> None:
    """The blocks the KV cache manager lets go behind a 21-key window reach the kernel as
    block 0: filled with NaN here, the output keeps the bits it has with every block."""
    torch.manual_seed(0)
    num_blocks, block_size, heads, kv_heads, head_dim = 80, 16, 9, 3, 64
    whole, let_go = batches_with_blocks_let_go(block_size, num_blocks, 7, shapes, 21, DEVICE)
    assert bool((let_go.block_tables != whole.block_tables).any())
    q, k, v = (torch.randn(whole.num_tokens, n, head_dim, device=DEVICE) for n in (heads, kv_heads, kv_heads))
    history = [torch.randn(num_blocks * block_size, kv_heads, head_dim, device=DEVICE) for _ in range(2)]
    backend = make_backend("triton", DEVICE, heads, kv_heads, head_dim)
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, device=DEVICE)
    write_token_major(cache, *history, torch.arange(num_blocks * block_size, device=DEVICE))
    expected = backend.forward(q, k, v, cache.clone(), whole, backend.prepare(whole), 21)
    poisoned = cache.clone()
    poisoned[:, 0] = float("nan")
    actual = backend.forward(q, k, v, poisoned, let_go, backend.prepare(let_go), 21)
    assert torch.equal(actual, expected)


def test_triton_split_shapes() -> None:
    """Splits of 16 blocks each, as many as the longest context needs, a power of two."""
    assert split_shape(1) == (1, 16) and split_shape(16) == (1, 16)
    assert split_shape(17) == (2, 16) and split_shape(40) == (4, 16)
    assert split_shape(10_000) == (1024, 16)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("shapes, target", [
    ([(300, 1), (5, 1), (900, 1)], 0),  # a decode of 19 blocks: 2 splits alone, 4 beside the longest
    ([(16, 16), (0, 7), (70, 1), (33, 9)], 0),  # a chunk after 16 cached tokens, in a mixed step
])
def test_triton_attention_is_batch_invariant(dtype, shapes, target) -> None:
    """A request's attention rows are bit for bit the same alone and in a batch of the
    same kind of step (its tiles, and its split ranges, do not depend on the others)."""
    block_size, heads, kv_heads, head_dim, num_blocks = 16, 6, 2, 32, 80
    backend = make_backend("triton", DEVICE, heads, kv_heads, head_dim)
    torch.manual_seed(3)
    history = [torch.randn(num_blocks * block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
               for _ in range(2)]
    slots = torch.arange(num_blocks * block_size, device=DEVICE)
    rows = {}
    for name, batch_shapes in (("batched", shapes), ("alone", [shapes[target]])):
        output = mixed_batch(block_size, num_blocks, seed=5, shapes=batch_shapes)
        batch = ForwardBatch.build(output, block_size, DEVICE)
        own, others = shapes[target][1], batch.num_tokens - shapes[target][1]
        mine, rest = torch.Generator().manual_seed(9), torch.Generator().manual_seed(10)
        q, k, v = (torch.cat([torch.randn(own, n, head_dim, generator=mine),  # the target's: the same draws
                              torch.randn(others, n, head_dim, generator=rest)]).to(dtype).to(DEVICE)
                   for n in (heads, kv_heads, kv_heads))
        cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
        write_token_major(cache, *history, slots)
        out = backend.forward(q, k, v, cache, batch, backend.prepare(batch))
        rows[name] = out[: shapes[target][1]]  # the target is the batch's first request
    assert torch.equal(rows["batched"], rows["alone"])


def test_triton_backend_serves_the_engine_as_the_reference_does(tiny_llama) -> None:
    """The backend inside the engine: chunked prefills, batching and decodes of a tiny
    Llama give torch_ref's greedy tokens (float32)."""
    from kvloom import LLM, SamplingParams

    prompts = [[5, 9, 14, 3, 77, 21, 8, 40, 2, 31, 60, 11, 7, 19, 23, 42, 5, 6], [12, 13], [99, 98, 97, 96, 95]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("triton", "torch_ref"):
        llm = LLM(str(tiny_llama), dtype="float32", attention_backend=backend, num_blocks=32, block_size=16,
                  max_num_batched_tokens=8, device=str(DEVICE))
        assert llm.engine.runner.backend.name == backend
        tokens[backend] = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch_ref"]
