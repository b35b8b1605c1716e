"""CPU tensors on 2 MiB pages (kernels/huge_pages.py): the advised range is the whole
pages inside a tensor, and an arena starts on a page boundary with the size asked for."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvloom.kernels.huge_pages import HUGE_PAGE, empty_on_huge_pages, huge_page_range, prefer_huge_pages

THP = sys.platform.startswith("linux") and Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()


def test_huge_page_range_is_the_aligned_interior() -> None:
    assert HUGE_PAGE == 2 * 1024 * 1024
    # Starts inside page 1, ends inside page 4: pages 2 and 3 are whole.
    assert huge_page_range(HUGE_PAGE + 64, 3 * HUGE_PAGE) == (2 * HUGE_PAGE, 2 * HUGE_PAGE)
    assert huge_page_range(0, 2 * HUGE_PAGE) == (0, 2 * HUGE_PAGE)  # aligned both ends
    assert huge_page_range(4096, HUGE_PAGE) == (HUGE_PAGE, 0)  # no whole page inside


@pytest.mark.parametrize(("numel", "dtype"), [(1, torch.bfloat16), (600_000, torch.bfloat16),
                                              (3 * HUGE_PAGE // 4 + 5, torch.float32)])
def test_an_arena_starts_on_a_huge_page_and_holds_what_was_asked(numel: int, dtype: torch.dtype) -> None:
    arena = empty_on_huge_pages(numel, dtype)
    assert arena.shape == (numel,) and arena.dtype == dtype and arena.is_contiguous()
    assert arena.data_ptr() % HUGE_PAGE == 0
    arena.fill_(3)  # all of it is writable memory of its own
    assert bool((arena == 3).all())
    if THP and numel * arena.element_size() >= HUGE_PAGE:
        # Linux with transparent huge pages built in takes the advice for whole pages.
        assert prefer_huge_pages(arena)


def test_a_tensor_with_no_whole_huge_page_inside_is_not_advised() -> None:
    assert not prefer_huge_pages(torch.empty(1000, dtype=torch.float32))
