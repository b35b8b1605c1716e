# Two builds of the latent kernel on one layer's 512-token prompt (9 heads, 288 wide, 256 of value), alternating.
import ctypes, sys, time, torch
libs = {}
for name in sys.argv[1:]:
    f = ctypes.CDLL(f"/tmp/s37/ab/{name}.so").kvloom_latent_attention
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    libs[name] = f
torch.manual_seed(0)
heads, dim, vdim, bs, n = 9, 288, 256, 16, 512
cache = torch.randn(1, n // bs, bs, 1, dim).bfloat16()
bt = torch.randperm(n // bs).to(torch.int32)[None]
q = torch.randn(n, heads, dim).bfloat16(); out = torch.empty(n, heads, vdim).bfloat16()
sl, st, ql = (torch.tensor([v], dtype=torch.int32) for v in (n, 0, n))
times = {name: [] for name in libs}
for r in range(8):
    for name, f in libs.items():
        t = time.perf_counter()
        f(q.data_ptr(), out.data_ptr(), cache.data_ptr(), bt.data_ptr(), bt.shape[1], sl.data_ptr(), st.data_ptr(), ql.data_ptr(), 1, heads, dim, vdim, bs, 0.1, 1, 1, 2)
        times[name].append(time.perf_counter() - t)
flops = heads * n * (n / 2) * (dim + vdim) * 2
for name, ts in times.items():
    ts.sort(); print(f"prefill 512 {name:8s} min {ts[0]*1e3:6.2f} med {ts[4]*1e3:6.2f} ms  {flops / ts[0] / 1e9:6.1f} GFLOP/s")
