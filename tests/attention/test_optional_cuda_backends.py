"""The optional CUDA backends, ``flashinfer`` and ``flash_attn``: their metadata (FlashInfer's
page CSR, FlashAttention's key offsets over the block table) against ``torch_ref`` on
mixed batches, through stand-ins that implement each library's documented call on CPU
(fake_flash_libraries.py); the refusals; and, on a GPU with the library installed, the
real kernels against ``torch_ref``."""

from __future__ import annotations

import sys

import pytest
import torch
from fake_flash_libraries import fake_flash_attn, fake_flashinfer
from helpers_attention import mixed_batch

from kvloom.attention.base import write_token_major
from kvloom.attention.registry import make_backend
from kvloom.batch import ForwardBatch

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# (tokens already computed, tokens this step): decodes, fresh prefills, chunks after a prefix.
MIXED = [(0, 1), (0, 7), (5, 1), (16, 16), (33, 9), (70, 1), (2, 30), (40, 3)]
# For 256-token blocks: requests over one, two and three blocks.
LONG = [(0, 1), (255, 1), (256, 1), (300, 20), (0, 40), (600, 2)]


def outputs(name: str, device: torch.device, shapes, dtype, heads, kv_heads, head_dim, block_size, window=0,
            softcap=0.0):
    """(backend's output, torch_ref's) for one batch over the same history in the pool."""
    torch.manual_seed(0)
    num_blocks = 12 if block_size >= 256 else 80
    batch = ForwardBatch.build(mixed_batch(block_size, num_blocks, seed=block_size + heads, shapes=shapes),
                               block_size, device)
    q, k, v = (torch.randn(batch.num_tokens, n, head_dim, dtype=dtype, device=device)
               for n in (heads, kv_heads, kv_heads))
    history = [torch.randn(num_blocks * block_size, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2)]
    results = []
    for backend_name in (name, "torch_ref"):
        backend = make_backend(backend_name, device, heads, kv_heads, head_dim)
        backend.softcap = softcap
        cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
        write_token_major(cache, *history, torch.arange(num_blocks * block_size, device=device))
        metadata = backend.prepare(batch)
        results.append([backend.forward(q, k, v, cache, batch, metadata, window) for _layer in range(2)][-1])
    return results


@pytest.fixture
def stand_ins(monkeypatch):
    """The stand-in libraries, and make_backend's CUDA check lifted for them."""
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer())
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn())
    monkeypatch.setattr("kvloom.attention.registry.CUDA_ONLY", frozenset())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (6, 2, 32, 32), (4, 4, 16, 16)])
def test_flashinfer_page_table_matches_reference(stand_ins, dtype, heads, kv_heads, head_dim, block_size) -> None:
    actual, expected = outputs("flashinfer", torch.device("cpu"), MIXED, dtype, heads, kv_heads, head_dim, block_size)
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_flashinfer_plans_once_per_step(stand_ins) -> None:
    backend = make_backend("flashinfer", torch.device("cpu"), 4, 2, 16)
    batch = ForwardBatch.build(mixed_batch(16, 40, seed=1, shapes=MIXED), 16, torch.device("cpu"))
    cache = torch.zeros(2, 40, 16, 2, 16)
    metadata = backend.prepare(batch)
    for _layer in range(3):
        q, k, v = torch.randn(batch.num_tokens, 4, 16), torch.randn(batch.num_tokens, 2, 16), \
            torch.randn(batch.num_tokens, 2, 16)
        backend.forward(q, k, v, cache, batch, metadata)
    assert backend._wrappers[0].plans == 1


def test_flash_attn_sliding_window_is_its_window_size(stand_ins) -> None:
    """A window of 21 keys is the query and the 20 before it: window_size (20, 0)."""
    actual, expected = outputs("flash_attn", torch.device("cpu"), LONG, torch.float32, 8, 2, 32, 256, window=21)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name,shapes,block_size", [("flashinfer", MIXED, 16), ("flash_attn", LONG, 256)])
def test_softcap_reaches_the_libraries(stand_ins, name, shapes, block_size) -> None:
    """Gemma 2's logit softcapping: FlashInfer's logits_soft_cap, FlashAttention's softcap."""
    actual, expected = outputs(name, torch.device("cpu"), shapes, torch.float32, 8, 2, 32, block_size, softcap=0.3)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


def test_flashinfer_plans_each_window_once_per_step(stand_ins) -> None:
    """Layers with a window of 21 keys (window_left 20: the keys before the query) and
    layers without one in one step: each kind's wrapper planned once, each layer equal to
    torch_ref's with its window."""
    torch.manual_seed(0)
    batch = ForwardBatch.build(mixed_batch(16, 40, seed=1, shapes=MIXED), 16, torch.device("cpu"))
    backends = [make_backend(name, torch.device("cpu"), 8, 2, 32) for name in ("flashinfer", "torch_ref")]
    caches = [torch.zeros(2, 40, 16, 2, 32) for _ in backends]
    for cache in caches:
        write_token_major(cache, *torch.randn(2, 40 * 16, 2, 32), torch.arange(40 * 16))
    caches[1].copy_(caches[0])
    plans = [backend.prepare(batch) for backend in backends]
    for window in (0, 21, 0, 21):
        q, k, v = torch.randn(batch.num_tokens, 8, 32), torch.randn(batch.num_tokens, 2, 32), \
            torch.randn(batch.num_tokens, 2, 32)
        actual, expected = (backend.forward(q, k, v, cache, batch, plan, window)
                            for backend, cache, plan in zip(backends, caches, plans, strict=True))
        torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)
    assert {window: wrapper.plans for window, wrapper in backends[0]._wrappers.items()} == {0: 1, 21: 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attn_block_table_matches_reference(stand_ins, dtype) -> None:
    actual, expected = outputs("flash_attn", torch.device("cpu"), LONG, dtype, 8, 2, 32, 256)
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_flash_attn_refuses_blocks_it_cannot_page(stand_ins) -> None:
    backend = make_backend("flash_attn", torch.device("cpu"), 4, 2, 16)
    batch = ForwardBatch.build(mixed_batch(16, 40, seed=1, shapes=MIXED), 16, torch.device("cpu"))
    with pytest.raises(ValueError, match="multiple of 256 tokens.*got block_size 16"):
        backend.prepare(batch)


@pytest.mark.parametrize("name,package,install", [("flashinfer", "flashinfer", "pip install flashinfer-python"),
                                                  ("flash_attn", "flash_attn", "pip install flash-attn")])
def test_a_missing_library_or_device_is_refused_by_name(monkeypatch, name, package, install) -> None:
    with pytest.raises(ValueError, match=f"attention_backend {name!r} runs on CUDA only, not cpu"):
        make_backend(name, torch.device("cpu"), 4, 2, 16)
    monkeypatch.setitem(sys.modules, package, None)  # importing it fails, as where it is not installed
    monkeypatch.setattr("kvloom.attention.registry.CUDA_ONLY", frozenset())
    with pytest.raises(ValueError, match=f"needs the {package} package \\({install}\\)"):
        make_backend(name, torch.device("cpu"), 4, 2, 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the libraries' kernels need a GPU")
@pytest.mark.parametrize("name,shapes,block_size", [("flashinfer", MIXED, 16), ("flash_attn", LONG, 256)])
def test_cuda_library_kernels_match_reference(name, shapes, block_size) -> None:
    pytest.importorskip(name, reason=f"{name} is not installed here")
    for dtype in (torch.float16, torch.bfloat16):
        actual, expected = outputs(name, torch.device("cuda"), shapes, dtype, 8, 2, 64, block_size)
        torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)
