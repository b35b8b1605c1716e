# The latent attention kernel alone: `python latent_kernel_bench.py HEADS PRODUCTS` (products: float32 or bf16),
# a 288-wide latent (256 of value), bf16, blocks of 16 scattered; min / median of 20 calls.
import torch, time, sys
from kvloom.kernels import latent_attention as la
torch.manual_seed(0)
dtype = torch.bfloat16
PROD = sys.argv[2] if len(sys.argv) > 2 else None
heads, dim, vdim = int(sys.argv[1]) if len(sys.argv) > 1 else 9, 288, 256
def bench(lens, reps=20):
    bs = 16
    nb = sum(-(-s // bs) for _, s in lens) + 1
    cache = torch.randn(1, nb, bs, 1, dim).to(dtype)
    maxb = max(-(-s // bs) for _, s in lens)
    perm = torch.randperm(nb).tolist()
    bt = torch.zeros(len(lens), maxb, dtype=torch.int32)
    for i, (_, s) in enumerate(lens):
        for b in range(-(-s // bs)): bt[i, b] = perm.pop()
    I = lambda a: torch.tensor(a, dtype=torch.int32)
    starts, st = [], 0
    for ql, _ in lens: starts.append(st); st += ql
    q = torch.randn(st, heads, dim).to(dtype)
    args = (q, cache, bt, I([s for _, s in lens]), I(starts), I([ql for ql, _ in lens]), vdim, 0.1, PROD)
    la.latent_attention(*args)
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); la.latent_attention(*args); ts.append(time.perf_counter() - t)
    ts.sort()
    flops = sum(ql * heads * (s - ql/2) * (dim + vdim) * 2 for ql, s in lens)
    print(f"{str(lens[:2]):30s} x{len(lens):3d}  min {ts[0]*1e3:7.3f} ms  med {ts[len(ts)//2]*1e3:7.3f} ms  {flops/ts[0]/1e9:6.1f} GFLOP/s")
bench([(1, 512)])
bench([(1, 512)] * 16)
bench([(1, 512)] * 64)
bench([(16, 528)])
bench([(512, 512)], reps=5)
