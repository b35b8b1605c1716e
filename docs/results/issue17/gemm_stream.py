"""The decoder's matmuls over 30 layers' distinct weights plus the output head, out of cache as
in a decode step, for builds of gemm.cpp at git revisions (WORK = the working tree), run
alternately: ms per pass of all 121 matmuls (median and min of 7), and whether the outputs
match the first build bit for bit.

    .venv/bin/python docs/results/issue17/gemm_stream.py avx2 1,16,64,128 HEAD WORK
"""
import ctypes, subprocess, sys, tempfile, time, statistics, shutil
from pathlib import Path
import torch
from kvloom import native
from kvloom.kernels import gemm
REPO = Path(__file__).parents[3]
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
def build(rev, into):
    if rev == "WORK":
        for f in (REPO / "kvloom/csrc").iterdir():
            if f.suffix == ".h" or f.name == "gemm.cpp": shutil.copy(f, into / f.name)
    else:
        names = subprocess.run(["git", "ls-tree", "--name-only", rev, "kvloom/csrc/"], cwd=REPO, check=True, capture_output=True, text=True).stdout.split()
        for name in names:
            if name.endswith((".h", "gemm.cpp")):
                (into / Path(name).name).write_bytes(subprocess.run(["git", "show", f"{rev}:{name}"], cwd=REPO, check=True, capture_output=True).stdout)
    cxx = native.compiler() or "g++"
    subprocess.run([cxx, *native.flags_for("gemm"), "-c", str(into / "gemm.cpp"), "-o", str(into / "gemm.o")], check=True)
    subprocess.run([cxx, *native.LINK_FLAGS, str(into / "gemm.o"), "-o", str(into / "gemm.so")], check=True)
    lib = ctypes.CDLL(str(into / "gemm.so"))
    lib.kvloom_gemm_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.kvloom_gemm_packed_elements.restype = ctypes.c_int64
    lib.kvloom_gemm_packed_elements.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.kvloom_gemm_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    return lib
def weights(lib):
    torch.manual_seed(0)
    out = []
    for n, k in LAYER * 30 + [(49152, 576)]:
        w = (torch.randn(n, k) / k ** 0.5).bfloat16()
        p = torch.empty(lib.kvloom_gemm_packed_elements(n, k), dtype=torch.bfloat16)
        lib.kvloom_gemm_pack(w.data_ptr(), n, k, p.data_ptr()); out.append((n, k, p))
    return out
def main():
    isa = gemm.ISAS.index(sys.argv[1]) + 1; rows = [int(r) for r in sys.argv[2].split(",")]; revs = sys.argv[3:]
    libs = []
    tmp = tempfile.mkdtemp()
    for r in revs:
        d = Path(tmp) / f"{len(libs)}_{r}"; d.mkdir(); libs.append(build(r, d))
    W = weights(libs[0])
    for m in rows:
        xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
        ys = [[torch.empty(m, n, dtype=torch.bfloat16) for n, k, p in W] for _ in libs]
        times = [[] for _ in libs]
        for rep in range(7):
            for i, lib in enumerate(libs):
                t = time.perf_counter()
                for (n, k, p), y in zip(W, ys[i]):
                    lib.kvloom_gemm_bf16(xs[k].data_ptr(), p.data_ptr(), None, y.data_ptr(), m, n, k, isa, 2)
                times[i].append(time.perf_counter() - t)
        same = all(all(torch.equal(a, b) for a, b in zip(ys[0], ys[i])) for i in range(1, len(libs)))
        print(f"M={m:4d} " + "  ".join(f"{r}: med {statistics.median(t)*1e3:7.2f} min {min(t)*1e3:7.2f}" for r, t in zip(revs, times)) + f"  bits {'same' if same else 'DIFF'}")
main()
