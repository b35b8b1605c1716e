"""Prompt attention over 8 x 256 (attention_paths.py's case), timed, then looped for SECONDS under
perf (notes.txt section 3):  perf record -e cpu-clock -- .venv/bin/python .../prompt_attn_loop.py 8"""
import sys, time, torch, pathlib
sys.path.insert(0, '/work/main/docs/results/issue17')
from attention_paths import case
from kvloom.kernels import paged_attention as kernels
torch.manual_seed(0); torch.set_num_threads(2); kernels.load()
call = case(8, 256, 256)[0]
call()
ts = []
end = time.time() + float(sys.argv[1]) if len(sys.argv) > 1 else 0
for _ in range(10):
    t = time.perf_counter(); call(); ts.append(time.perf_counter() - t)
print('median ms', sorted(ts)[5] * 1e3)
while time.time() < end: call()
# causal work: 8 prompts x 256: sum L(L+1)/2 * 4 * 64 * 9 heads * 30 layers
flops = 8 * 256 * 257 / 2 * 4 * 64 * 9 * 30
print('GFLOP/s', flops / sorted(ts)[5] / 1e9)
