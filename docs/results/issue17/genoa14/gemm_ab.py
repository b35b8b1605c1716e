"""In-process alternating A/B of two gemm.cpp builds (folders holding gemm.cpp + headers):
per shape, rounds alternate A and B, each a timed loop; prints medians and the per-round ratio
median, and whether outputs are bit-identical.  usage: gemm_ab.py A_DIR B_DIR [ROUNDS]
THREADS (default 2), SHAPES 'n x k x m,...' (default the default model's matmuls at several M), ISA (gemm.cpp's
enum: 4 AMX, 3 AVX512-BF16; default 3) and ISA_B (B's path, default ISA: one build's two paths as A and B)."""
import os, statistics, sys, tempfile, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).parents[1]))
from gemm_revisions import build  # noqa: E402 (a folder's gemm.cpp and headers, built as kvloom builds them)

def main() -> None:
    a_dir, b_dir = Path(sys.argv[1]), Path(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    threads = int(os.environ.get("THREADS", "2"))
    isa = int(os.environ.get("ISA", "3"))
    isas = {"A": isa, "B": int(os.environ.get("ISA_B", isa))}
    spec = os.environ.get("SHAPES", "3072x576x16,3072x576x64,3072x576x256,3072x576x2048,576x1536x64,960x576x32")
    shapes = [tuple(int(v) for v in s.split("x")) for s in spec.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "a").mkdir(); (Path(tmp) / "b").mkdir()
        libs = {"A": build(str(a_dir), Path(tmp) / "a"), "B": build(str(b_dir), Path(tmp) / "b")}
        torch.manual_seed(0)
        for n, k, m in shapes:
            w = (torch.randn(n, k) / k ** 0.5).bfloat16()
            packed = torch.empty(libs["A"].kvloom_gemm_packed_elements(n, k), dtype=torch.bfloat16)
            libs["A"].kvloom_gemm_pack(w.data_ptr(), n, k, packed.data_ptr())
            x = torch.randn(m, k).bfloat16()
            ys = {name: torch.empty(m, n, dtype=torch.bfloat16) for name in libs}
            loops = max(3, int(2e9 / (2 * m * n * k)))
            times = {name: [] for name in libs}
            for r in range(rounds):
                for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                    f, y = libs[name].kvloom_gemm_bf16, ys[name]
                    assert f(x.data_ptr(), packed.data_ptr(), None, y.data_ptr(), m, n, k, isas[name], threads) == 0
                    t = time.perf_counter()
                    for _ in range(loops):
                        f(x.data_ptr(), packed.data_ptr(), None, y.data_ptr(), m, n, k, isas[name], threads)
                    times[name].append((time.perf_counter() - t) / loops)
            ratios = sorted(a / b for a, b in zip(times["A"], times["B"]))
            ga, gb = (2 * m * n * k / statistics.median(times[nm]) / 1e9 for nm in "AB")
            same = torch.equal(ys["A"], ys["B"])
            print(f"{n}x{k} M={m} t={threads}: A {ga:.1f} B {gb:.1f} GFLOP/s; A/B time median {statistics.median(ratios):.3f} "
                  f"[{ratios[0]:.3f}, {ratios[-1]:.3f}] {'bit-identical' if same else 'DIFFERENT'}")

main()
