"""Per-kernel time inside the native decoder stack (instrumented worktree build), decode steps
at BATCH x CONTEXT. usage: PYTHONPATH=/tmp/s13/wt python stack_times.py BATCH STEPS [CONTEXT]"""
import sys, time, random, statistics, ctypes
import kvloom, kvloom.native as native
assert "/tmp/s13/wt" in kvloom.__file__, kvloom.__file__
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import SamplingParams
from kvloom.models.default_model import resolve_default_model
batch = int(sys.argv[1]); steps = int(sys.argv[2]); ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 300
eng = LLMEngine(EngineConfig.from_kwargs(str(resolve_default_model()), dtype="bfloat16", enable_prefix_caching=False,
                max_num_seqs=256, num_blocks=6000))
rng = random.Random(0)
params = SamplingParams(max_tokens=steps + 40, temperature=0.0, ignore_eos=True)
for _ in range(batch):
    eng.add_request([rng.randrange(10, 40000) for _ in range(ctx - steps // 2)], params)
while True:
    outs = eng.step()
    if len(outs) == batch and all(o.outputs[0].token_ids for o in outs): break
for _ in range(3): eng.step()
lib = native.load("decoder_stack")
buf0 = (ctypes.c_uint64 * 32)(); buf = (ctypes.c_uint64 * 32)()
lib.kvloom_stack_times(buf0)
total = []
for _ in range(steps):
    t = time.perf_counter(); eng.step(); total.append(time.perf_counter() - t)
lib.kvloom_stack_times(buf)
names = ["rms_in", "qkv", "rotary", "write_kv", "attention", "o", "rms_post", "gate_up", "silu", "down"]
n_per = {"qkv": 576*960, "o": 576*576, "gate_up": 576*3072, "down": 1536*576}
tsc = 2.596e9
print(f"b{batch} ctx{ctx} step median {statistics.median(total)*1e3:.2f} ms")
s = [0, 0]
for i, nme in enumerate(names):
    ms = [(buf[i + 16*w] - buf0[i + 16*w]) / tsc / steps * 1e3 for w in (0, 1)]
    s[0] += ms[0]; s[1] += ms[1]
    extra = ""
    if nme in n_per:
        rows = batch / (2 if ms[1] > 0 else 1)
        extra = "  GFLOP/s per walk " + " ".join(f"{2*rows*n_per[nme]*30/(m*1e-3)/1e9:6.1f}" for m in ms if m > 0)
    print(f"  {nme:10s} {ms[0]:7.3f} {ms[1]:7.3f} ms/step{extra}")
print(f"  sum        {s[0]:7.3f} {s[1]:7.3f}")
