import time, torch
from kvloom.kernels import ssm
torch.manual_seed(0)
def bench(f, k=50):
    f(); t = time.perf_counter()
    for _ in range(k): f()
    return round((time.perf_counter() - t) / k * 1e6, 1)
for n in (1, 16, 64):
    heads, p, d, g, k = 18, 64, 64, 1, 4
    inter = heads * p; conv_dim = inter + 2 * g * d
    proj = torch.randn(n, inter + conv_dim + heads).bfloat16()
    wt = torch.randn(k, conv_dim); cb = torch.randn(conv_dim)
    cs = torch.randn(n, k - 1, conv_dim).bfloat16(); ss = torch.randn(n, heads, p, d)
    dtb, al, D = torch.randn(heads), torch.randn(heads), torch.randn(heads); nw = torch.randn(inter).bfloat16()
    starts = torch.arange(n); lengths = torch.ones(n, dtype=torch.int64); slots = torch.arange(n); hs = torch.ones(n, dtype=torch.int32)
    full = bench(lambda: ssm.mamba_mixer(proj, wt, cb, cs, ss, dtb, al, D, nw, starts, lengths, slots, hs, g, 0.0, float("inf"), 1e-6))
    xbc = proj[:, inter:inter + conv_dim].contiguous()
    conv = bench(lambda: ssm.causal_conv(xbc, wt, cb, cs, starts, lengths, slots, hs))
    x = torch.randn(n, heads, p); dt = torch.rand(n, heads); B = torch.randn(n, heads, d); C = torch.randn(n, heads, d)
    scan = bench(lambda: ssm.ssm_scan_(ss, slots, hs, starts, lengths, x, dt, al, B, C, D))
    print(n, "mixer", full, "us; conv", conv, "scan", scan)
