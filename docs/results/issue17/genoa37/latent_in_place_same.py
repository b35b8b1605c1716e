# The two builds of latent_in_place_ab.py give the same bits (bf16 products; widths 288, 576, 40, 64; blocks 16, 32).
import ctypes, torch
from pathlib import Path
libs = {}
for name in ("base", "zc"):
    f = ctypes.CDLL(f"/tmp/s37/ab/{name}.so").kvloom_latent_attention
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    libs[name] = f
torch.manual_seed(1)
for heads, dim, vdim, bs, lens in ((9, 288, 256, 16, [(1, 512), (5, 40), (16, 528), (1, 17)]), (16, 576, 512, 32, [(1, 100), (33, 70)]),
                                   (3, 40, 32, 16, [(4, 20)]), (4, 64, 48, 16, [(2, 50)])):
    nb = sum(-(-s // bs) for _, s in lens) + 2
    cache = torch.randn(1, nb, bs, 1, dim).bfloat16()
    perm = torch.randperm(nb).tolist(); maxb = max(-(-s // bs) for _, s in lens)
    bt = torch.zeros(len(lens), maxb, dtype=torch.int32)
    for i, (_, s) in enumerate(lens):
        for b in range(-(-s // bs)): bt[i, b] = perm.pop()
    I = lambda a: torch.tensor(a, dtype=torch.int32)
    starts, st = [], 0
    for ql, _ in lens: starts.append(st); st += ql
    q = torch.randn(st, heads, dim).bfloat16()
    outs = {}
    sl, sts, qls = I([s for _, s in lens]), I(starts), I([ql for ql, _ in lens])
    for name, f in libs.items():
        out = torch.empty(st, heads, vdim).bfloat16()
        rc = f(q.data_ptr(), out.data_ptr(), cache.data_ptr(), bt.data_ptr(), maxb, sl.data_ptr(), sts.data_ptr(), qls.data_ptr(), len(lens), heads, dim, vdim, bs, 0.1, 1, 1, 2)
        assert rc == 0
        outs[name] = out
    print(dim, bs, "same bits:", torch.equal(outs["base"].view(torch.int16), outs["zc"].view(torch.int16)))
