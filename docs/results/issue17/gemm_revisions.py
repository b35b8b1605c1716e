"""kvloom's GEMM as it was at several git revisions, side by side on this machine: each
revision's csrc/gemm.cpp (with that revision's headers) is built with kvloom's flags,
timed on the default model's matmul shapes (GFLOP/s, best of 3 loops, 2 threads) on one
path, and its outputs compared with the first revision's bit for bit.

    .venv/bin/python docs/results/issue17/gemm_revisions.py avx2 7d18248 HEAD   (WORK: the working tree)
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kvloom import native
from kvloom.kernels import gemm

sys.path.insert(0, str(Path(__file__).parents[1]))
from gemm_vs_onednn import best_ms  # noqa: E402 (the timer of that comparison: best of 3 loops)

SHAPES = {"qkv 960x576": (960, 576), "gate/up 3072x576": (3072, 576), "down 576x1536": (576, 1536),
          "lm_head 49152x576": (49152, 576)}
ROWS = (1, 16, 64, 512)
REPO = Path(__file__).parents[3]


def build(revision: str, into: Path) -> ctypes.CDLL:
    """That revision's gemm.cpp and headers (WORK: the working tree's; a folder's path: the
    gemm.cpp and headers in it), compiled and linked as kvloom/native.py does."""
    folder = REPO / "kvloom/csrc" if revision == "WORK" else Path(revision) if Path(revision).is_dir() else None
    if folder is not None:
        for path in folder.iterdir():
            if path.suffix == ".h" or path.name == "gemm.cpp":
                (into / path.name).write_bytes(path.read_bytes())
    names = [] if folder is not None else subprocess.run(
        ["git", "ls-tree", "--name-only", revision, "kvloom/csrc/"], cwd=REPO, check=True,
        capture_output=True, text=True).stdout.split()
    for name in names:
        if name.endswith((".h", "gemm.cpp")):
            text = subprocess.run(["git", "show", f"{revision}:{name}"], cwd=REPO, check=True,
                                  capture_output=True).stdout
            (into / Path(name).name).write_bytes(text)
    native.compile_library(into / "gemm.cpp", into / "gemm.so", native.flags_for("gemm"))
    library = ctypes.CDLL(str(into / "gemm.so"))
    library.kvloom_gemm_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    library.kvloom_gemm_packed_elements.restype = ctypes.c_int64
    library.kvloom_gemm_packed_elements.argtypes = [ctypes.c_int64, ctypes.c_int64]
    library.kvloom_gemm_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    return library


def measure(library: ctypes.CDLL, isa: int) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    rates, outputs = [], []
    for n, k in SHAPES.values():
        weight = (torch.randn(n, k) / k ** 0.5).bfloat16()
        packed = torch.empty(library.kvloom_gemm_packed_elements(n, k), dtype=torch.bfloat16)
        library.kvloom_gemm_pack(weight.data_ptr(), n, k, packed.data_ptr())
        for m in ROWS:
            x, y = torch.randn(m, k).bfloat16(), torch.empty(m, n, dtype=torch.bfloat16)
            def call(x=x, y=y, m=m, n=n, k=k, packed=packed) -> None:
                library.kvloom_gemm_bf16(x.data_ptr(), packed.data_ptr(), None, y.data_ptr(), m, n, k, isa, 2)
            rates.append(2 * m * n * k / best_ms(call, max(3, int(3e8 / (2 * m * n * k)))) / 1e6)
            outputs.append(y.clone())
    return rates, outputs


def main() -> None:
    isa, revisions = sys.argv[1], sys.argv[2:]
    code = gemm.ISAS.index(isa) + 1  # gemm.cpp's enum
    columns = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, revision in enumerate(revisions):
            where = Path(tmp) / f"{i}-{Path(revision).name}"  # a folder: its last part
            where.mkdir()
            columns.append(measure(build(revision, where), code))
    print(f"GFLOP/s on the {isa} path, 2 threads; " + ", ".join(
        f"{r}: {'bit-identical to ' + revisions[0] if all(torch.equal(a, b) for a, b in zip(columns[0][1], c[1])) else 'DIFFERENT from ' + revisions[0]}"
        for r, c in zip(revisions[1:], columns[1:])))
    print("| shape | M | " + " | ".join(revisions) + " |")
    print("|---|---|" + "---|" * len(revisions))
    cells = iter(range(len(SHAPES) * len(ROWS)))
    for name in SHAPES:
        for m in ROWS:
            i = next(cells)
            print(f"| {name} | {m} | " + " | ".join(f"{c[0][i]:.0f}" for c in columns) + " |")


if __name__ == "__main__":
    main()
