"""Paired-layout decode attention (or, with QLEN, prefill) out of cache, as in a step (30
layers' distinct caches, or LAYERS, the default model's 9 query and 3 kv heads of 64 dims, blocks of 16 scattered
over the pool), for builds of paged_attention.cpp at git revisions (WORK = the working
tree), run alternately, on the build's best vector path (or ATTENTION_PATH=avx2 ...): ms per pass of the 30 layers (median and min of 9), the KV read
rate at the median, and whether the outputs match the first build bit for bit.

    .venv/bin/python docs/results/issue17/attention_stream.py 64x300,16x300,64x1000 HEAD WORK
    QLEN=256 LAYERS=8 .venv/bin/python docs/results/issue17/attention_stream.py 8x256 HEAD WORK   (prefill)
"""
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

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
REPO = Path(__file__).parents[3]
PATHS = ("avx2", "avx512", "avx512_bf16", "amx")  # paged_attention.cpp's PairedPath
PATH = os.environ.get("ATTENTION_PATH", "")
QLEN = int(os.environ.get("QLEN", "1"))  # query rows a sequence: 1 decodes; the context, a prefill
LAYERS = int(os.environ.get("LAYERS", "30"))


def build(revision: str, into: Path) -> ctypes.CDLL:
    """That revision's paged_attention.cpp and headers, compiled as kvloom/native.py does."""
    if revision == "WORK":
        for path in (REPO / "kvloom/csrc").iterdir():
            if path.suffix == ".h" or path.name == "paged_attention.cpp":
                (into / path.name).write_bytes(path.read_bytes())
    else:
        names = subprocess.run(["git", "ls-tree", "--name-only", revision, "kvloom/csrc/"], cwd=REPO,
                               check=True, capture_output=True, text=True).stdout.split()
        for name in names:
            if name.endswith((".h", "paged_attention.cpp")):
                text = subprocess.run(["git", "show", f"{revision}:{name}"], cwd=REPO, check=True,
                                      capture_output=True).stdout
                (into / Path(name).name).write_bytes(text)
    native.compile_library(into / "paged_attention.cpp", into / "attention.so",
                           native.flags_for("paged_attention"))
    library = ctypes.CDLL(str(into / "attention.so"))
    if PATH in PATHS:  # else the build's best vector path
        assert library.kvloom_paired_attention_isa(PATHS.index(PATH)) == PATHS.index(PATH), PATH
    library.kvloom_paged_attention.argtypes = (
        [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5
        + [ctypes.c_float, ctypes.c_int, ctypes.c_int])
    return library


def case(batch: int, context: int):
    blocks = -(-context // BLOCK)
    total = batch * blocks
    caches = [torch.empty(2, total, BLOCK * KV_HEADS * DIM, dtype=torch.bfloat16).normal_() for _ in range(LAYERS)]
    tables = torch.randperm(total).int().view(batch, blocks).contiguous()
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    query_lens = torch.full((batch,), QLEN, dtype=torch.int32)
    query_start = torch.arange(batch, dtype=torch.int32) * QLEN
    q = torch.randn(batch * QLEN, HEADS, DIM).bfloat16()
    return caches, tables, seq_lens, query_start, query_lens, q


def run(library, caches, tables, seq_lens, query_start, query_lens, q, outs) -> None:
    batch, blocks = tables.shape
    for cache, out in zip(caches, outs):
        library.kvloom_paged_attention(q.data_ptr(), out.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(),
                                       tables.data_ptr(), blocks, seq_lens.data_ptr(), query_start.data_ptr(),
                                       query_lens.data_ptr(), batch, HEADS, KV_HEADS, DIM, BLOCK, 0.125, 2, 2)


def main() -> None:
    shapes = [tuple(int(x) for x in s.split("x")) for s in sys.argv[1].split(",")]
    revisions = sys.argv[2:]
    tmp = Path(tempfile.mkdtemp())
    libraries = []
    for i, revision in enumerate(revisions):
        (tmp / str(i)).mkdir()
        libraries.append(build(revision, tmp / str(i)))
    torch.manual_seed(0)
    for batch, context in shapes:
        data = case(batch, context)
        outs = [[torch.empty(batch * QLEN, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)] for _ in libraries]
        times = [[] for _ in libraries]
        for rep in range(10):
            for i, library in enumerate(libraries):
                start = time.perf_counter()
                run(library, *data, outs[i])
                if rep:  # the first pass warms the threads
                    times[i].append(time.perf_counter() - start)
        same = all(all(torch.equal(a, b) for a, b in zip(outs[0], o)) for o in outs[1:])
        kv = 2 * batch * context * KV_HEADS * DIM * 2 * LAYERS
        cells = "  ".join(f"{r}: med {statistics.median(t) * 1e3:6.2f} min {min(t) * 1e3:6.2f} "
                          f"({kv / statistics.median(t) / 1e9:4.1f} GB/s)" for r, t in zip(revisions, times))
        print(f"b{batch} x {context}: {cells}  {'bits same' if same else 'BITS DIFFER'}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
