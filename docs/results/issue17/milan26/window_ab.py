"""paged_attention.cpp before the sliding window and softcap (REVISION, default a731b12)
against this checkout's (with neither), in one process, alternated round by round; the default model's heads (9 on
3 kv heads of 64), 30 layers, blocks of 16 scattered over the pool, the build's best
paired path. Cases: (seqs, context, query rows each). Then this checkout's kernel with a
window against none on long contexts (what a window saves).

    .venv/bin/python docs/results/issue17/milan26/window_ab.py [ROUNDS]
"""

from __future__ import annotations

import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvloom import native

REPO = Path(__file__).resolve().parents[4]
REVISION = os.environ.get("REVISION", "a731b12")
HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
CASES = [tuple(int(n) for n in c.split("x")) for c in os.environ["CASES"].split(",")] if os.environ.get("CASES") \
    else [(16, 300, 1), (64, 300, 1), (8, 256, 256), (2, 1000, 1000)]


def build(csrc: Path, into: Path, windowed: bool) -> ctypes.CDLL:
    native.compile_library(csrc / "paged_attention.cpp", into / "attention.so", native.flags_for("paged_attention"))
    library = ctypes.CDLL(str(into / "attention.so"))
    window = [ctypes.c_int64, ctypes.c_float] if windowed else []  # window, softcap
    library.kvloom_paged_attention.argtypes = (
        [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5
        + [ctypes.c_float] + window + [ctypes.c_int, ctypes.c_int])
    return library


def old_sources(into: Path) -> Path:
    names = subprocess.run(["git", "ls-tree", "--name-only", REVISION, "kvloom/csrc/"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "show", f"{REVISION}:{name}"], cwd=REPO, check=True, capture_output=True).stdout
        (into / Path(name).name).write_bytes(blob)
    return into


def case(seqs: int, context: int, rows: int):
    blocks = -(-context // BLOCK)
    caches = [torch.empty(2, seqs * blocks, BLOCK * KV_HEADS * DIM, dtype=torch.bfloat16).normal_()
              for _ in range(LAYERS)]
    tables = torch.randperm(seqs * blocks).int().view(seqs, blocks).contiguous()
    seq_lens = torch.full((seqs,), context, dtype=torch.int32)
    query_lens = torch.full((seqs,), rows, dtype=torch.int32)
    query_start = torch.arange(seqs, dtype=torch.int32) * rows
    q = torch.randn(seqs * rows, HEADS, DIM).bfloat16()
    out = torch.empty_like(q)
    return caches, tables, seq_lens, query_start, query_lens, q, out


def timed(library, data, window: int | None) -> float:
    caches, tables, seq_lens, query_start, query_lens, q, out = data
    extra = [] if window is None else [window, 0.0]  # no softcap
    start = time.perf_counter()
    for cache in caches:
        library.kvloom_paged_attention(q.data_ptr(), out.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(),
                                       tables.data_ptr(), tables.shape[1], seq_lens.data_ptr(),
                                       query_start.data_ptr(), query_lens.data_ptr(), tables.shape[0], HEADS,
                                       KV_HEADS, DIM, BLOCK, 0.125, *extra, torch.get_num_threads(), 2)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp())
    (tmp / "old").mkdir(), (tmp / "new").mkdir()
    old = build(old_sources(tmp / "old"), tmp / "old", windowed=False)
    new = build(REPO / "kvloom" / "csrc", tmp / "new", windowed=True)
    print(f"torch threads {torch.get_num_threads()}; {REVISION} (old) vs this checkout (new), no window; ms for "
          f"{LAYERS} layers, median of {rounds} alternating rounds")
    for shape in CASES:
        data = case(*shape)
        times: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(rounds):
            order = (("old", old, None), ("new", new, 0)) if r % 2 == 0 else (("new", new, 0), ("old", old, None))
            for name, library, window in order:
                timed(library, data, window)
                times[name].append(timed(library, data, window))
        ratios = sorted(a / b for a, b in zip(times["old"], times["new"], strict=True))
        print(f"{shape}: old {statistics.median(times['old']):.2f} ms, new {statistics.median(times['new']):.2f} ms; "
              f"old/new per round median {statistics.median(ratios):.3f} [{ratios[0]:.3f}, {ratios[-1]:.3f}]")
    print("this checkout, a window against none")
    for shape, window in (((16, 2000, 1), 256), ((2, 2000, 500), 256)):
        data = case(*shape)
        times = {0: [], window: []}
        for _ in range(rounds):
            for w in (0, window):
                timed(new, data, w)
                times[w].append(timed(new, data, w))
        print(f"{shape}: no window {statistics.median(times[0]):.2f} ms, window {window} "
              f"{statistics.median(times[window]):.2f} ms")


if __name__ == "__main__":
    main()
