"""csrc/work_shares.h, the GEMM's split of work between threads: a thread walks its own
share from the front, then takes units from the back of the share with the most left;
every unit is handed out exactly once, whatever the threads and however they race.

Built here from a small C++ driver that includes the header (the GEMM's use of it is
held to the float32 reference and to row invariance in test_gemm.py)."""

from __future__ import annotations

import ctypes
import random

import pytest

from kvloom import native

DRIVER = r"""
#include <atomic>
#include <cstdint>
#include <omp.h>
#include "work_shares.h"

extern "C" {
// One thread, as thread `self`, takes units until none is left: (share, index, stolen) triples.
int64_t walk_alone(int self, int count, const int64_t* sizes, int64_t* out) {
  kvloom_work::WorkShares shares(count, [&](int s) { return sizes[s]; });
  kvloom_work::Unit unit;
  int64_t n = 0;
  while (shares.next(self, unit)) {
    out[3 * n] = unit.share, out[3 * n + 1] = unit.index, out[3 * n + 2] = unit.stolen;
    ++n;
  }
  return n;
}

// `threads` threads (thread t owns share t; shares past the team have no owner) count
// every unit they are given, units of share s at taken[offset[s] + index].
void race(int threads, int count, const int64_t* sizes, const int64_t* offset, int64_t* taken) {
  kvloom_work::WorkShares shares(count, [&](int s) { return sizes[s]; });
#pragma omp parallel num_threads(threads)
  {
    kvloom_work::Unit unit;
    while (shares.next(omp_get_thread_num(), unit))
      __atomic_fetch_add(&taken[offset[unit.share] + unit.index], 1, __ATOMIC_RELAXED);
  }
}
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> ctypes.CDLL:
    where = tmp_path_factory.mktemp("work_shares")
    (where / "driver.cpp").write_text(DRIVER)
    native.compile_library(where / "driver.cpp", where / "driver.so", [*native.FLAGS, "-I", str(native.SOURCES)])
    library = ctypes.CDLL(str(where / "driver.so"))
    library.walk_alone.restype = ctypes.c_int64
    library.walk_alone.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    library.race.argtypes = [ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 3
    return library


def int64s(values: list[int]) -> ctypes.Array:
    return (ctypes.c_int64 * max(1, len(values)))(*values)


def expected_walk(self: int, sizes: list[int]) -> list[tuple[int, int, int]]:
    """The order the header promises to a thread that finds no one else working: its own
    share front to back, then one unit at a time from the back of the fullest share (the
    first of equals)."""
    order = [(self, i, 0) for i in range(sizes[self])]
    left = [(0, size) for size in sizes]
    left[self] = (sizes[self], sizes[self])
    while any(back > front for front, back in left):
        victim = max(range(len(left)), key=lambda s: (left[s][1] - left[s][0], -s))
        front, back = left[victim]
        order.append((victim, back - 1, 1))
        left[victim] = (front, back - 1)
    return order


@pytest.mark.parametrize(("self", "sizes"), [
    (0, [5, 5]), (1, [5, 5]), (0, [0, 4]), (0, [3, 0, 7, 2]), (2, [1, 6, 0, 6]), (0, [0]), (0, [1]),
])
def test_a_lone_thread_takes_its_share_in_order_then_steals_from_the_fullest(driver, self, sizes) -> None:
    out = int64s([0] * 3 * sum(sizes))
    n = driver.walk_alone(self, len(sizes), int64s(sizes), out)
    got = [tuple(out[3 * i:3 * i + 3]) for i in range(n)]
    assert got == expected_walk(self, sizes)


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_racing_threads_take_every_unit_exactly_once(driver, threads) -> None:
    rng = random.Random(threads)
    for _ in range(20):
        # as many shares as threads, or more (the team's extra shares have no owner)
        count = threads + rng.choice([0, 0, 2])
        sizes = [rng.choice([0, 1, 3, 40, 500]) for _ in range(count)]
        offsets = [sum(sizes[:s]) for s in range(count)]
        taken = int64s([0] * sum(sizes))
        driver.race(threads, count, int64s(sizes), int64s(offsets), taken)
        assert list(taken[:sum(sizes)]) == [1] * sum(sizes), sizes
