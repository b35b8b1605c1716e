"""Two builds of paged_attention.cpp in one process, alternated call by call: A is this
checkout's kvloom/csrc, B the csrc folder given (e.g. a worktree of the commit before).
On this noisy VM two processes of the same build differ by up to 20% (the prefill cases
moved 92 -> 113 ms a minute apart); in one process the per-round ratio of A to B stays
within ~1.5% on the compute-bound prompt cases. The cases are attention_paths.py's
(30 layers of the default model's heads, blocks of 16 scattered over the pool).

    git worktree add /tmp/before HEAD~1
    .venv/bin/python docs/results/issue17/attention_ab.py /tmp/before/kvloom/csrc [ROUNDS]

THREADS=1 runs both on one thread (default 2); SHAPES="64x600x1,16x300x1" (seqs x context x
query rows) replaces the cases below.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from attention_paths import case  # noqa: E402

from kvloom import native  # noqa: E402
from kvloom.kernels import paged_attention as kernels  # noqa: E402

# (seqs, context, query rows)
SHAPES = [tuple(int(n) for n in shape.split("x")) for shape in os.environ["SHAPES"].split(",")] \
    if os.environ.get("SHAPES") else [(8, 256, 256), (2, 1000, 1000), (64, 300, 1), (16, 300, 1)]


def build_b(csrc: pathlib.Path) -> ctypes.CDLL:
    """The library built from ``csrc`` (cached beside this checkout's builds)."""
    here, native.SOURCES = native.SOURCES, csrc
    try:
        cxx = native.compiler()
        assert cxx is not None, "no C++ compiler"
        target = native.cache_dir() / f"paged_attention-{native.build_key('paged_attention', cxx)}.so"
        if not target.exists():
            native.compile_library(csrc / "paged_attention.cpp", target, native.flags_for("paged_attention"))
    finally:
        native.SOURCES = here
    return ctypes.CDLL(str(target))


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    kernels.load()
    function = kernels.PAGED_ATTENTION.native
    calls = [case(*shape)[0] for shape in SHAPES]
    calls[0]()
    a = function._functions
    library = build_b(pathlib.Path(sys.argv[1]))
    here = native.load_optional
    native.load_optional = lambda name: library  # type: ignore[assignment]
    b = function._load()
    native.load_optional = here
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    times: dict[tuple[int, str], list[float]] = {(i, k): [] for i in range(len(SHAPES)) for k in "AB"}
    for r in range(rounds):
        for i, call in enumerate(calls):
            for name, functions in (("A", a), ("B", b)) if r % 2 == 0 else (("B", b), ("A", a)):
                function._functions = functions
                call()
                start = time.perf_counter()
                call()
                call()
                times[(i, name)].append((time.perf_counter() - start) / 2 * 1e3)
    for i, shape in enumerate(SHAPES):
        ta, tb = times[(i, "A")], times[(i, "B")]
        ratios = sorted(x / y for x, y in zip(ta, tb, strict=True))
        print(f"{shape}: A median {statistics.median(ta):.2f} ms, B median {statistics.median(tb):.2f} ms; "
              f"A/B per round median {statistics.median(ratios):.3f} [{ratios[0]:.3f}, {ratios[-1]:.3f}]")


if __name__ == "__main__":
    main()
