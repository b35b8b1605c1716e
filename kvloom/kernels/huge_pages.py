"""CPU tensors on 2 MiB pages, for the memory a step streams through.

A decode step reads every weight and a scattered set of KV blocks from memory; on 4 KiB
pages that is a TLB miss every 4 KiB (the KV pool's blocks are scattered; each thread's
share of a packed weight starts a fresh run of pages per matmul). Linux backs anonymous
memory with 2 MiB pages where asked (``madvise(MADV_HUGEPAGE)``; transparent huge pages
are often "madvise"-only), as long as nothing has touched it yet. Measured on AMD EPYC
model 17: decode attention 3-8% faster, the 30 layers' matmuls and head 2-7%
(docs/benchmarks.md). The advice changes no value; where the kernel does not take it the
memory is plain pages.
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


def huge_page_range(address: int, nbytes: int) -> tuple[int, int]:
    """The 2 MiB-aligned part of [address, address + nbytes): (start, length), length 0
    when no whole huge page fits."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return start, max(0, end - start)


def prefer_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back the whole 2 MiB pages inside a CPU tensor's untouched memory
    with huge pages. False where the kernel does not take the advice (not Linux, THP
    off) or no whole page fits."""
    start, length = huge_page_range(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    if not length or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    status: int = libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_HUGEPAGE)
    return status == 0


def empty_on_huge_pages(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat, uninitialised CPU tensor starting on a 2 MiB boundary, its pages advised
    before anything touches them, so that all of it can be huge pages (a plain
    allocation covers only the whole pages inside it: none for a tensor under 2 MiB).
    Costs at most 2 MiB of address space more than ``numel`` elements."""
    raw = torch.empty(numel + HUGE_PAGE // dtype.itemsize, dtype=dtype)
    skip = (-raw.data_ptr() % HUGE_PAGE) // dtype.itemsize  # the allocator's alignment divides the page
    out = raw[skip:skip + numel]  # a view: it keeps the whole allocation alive
    prefer_huge_pages(out)
    return out
