"""Per-kernel time inside the native decoder stack for prompt steps of SEQS x LEN tokens (instrumented
build in /tmp/s13/wt). usage: PYTHONPATH=/tmp/s13/wt python prompt_kernels.py SEQS LEN STEPS"""
import sys, time, random, statistics, ctypes
import kvloom, kvloom.native as native
assert "/tmp/s13/wt" in kvloom.__file__, kvloom.__file__
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import SamplingParams
from kvloom.models.default_model import resolve_default_model
seqs, length, steps = (int(v) for v in sys.argv[1:4])
eng = LLMEngine(EngineConfig.from_kwargs(str(resolve_default_model()), dtype="bfloat16", enable_prefix_caching=False,
                max_num_seqs=256, num_blocks=8000, max_num_batched_tokens=max(2048, seqs * length)))
rng = random.Random(0)
params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
lib = native.load("decoder_stack")
def one_step():
    for _ in range(seqs):
        eng.add_request([rng.randrange(10, 40000) for _ in range(length)], params)
    t = time.perf_counter(); eng.step(); dt = time.perf_counter() - t
    while eng.has_unfinished_requests(): eng.step()
    return dt
one_step(); one_step()
buf0 = (ctypes.c_uint64 * 32)(); buf = (ctypes.c_uint64 * 32)()
lib.kvloom_stack_times(buf0)
total = [one_step() for _ in range(steps)]
lib.kvloom_stack_times(buf)
names = ["rms_in", "qkv", "rotary", "write_kv", "attention", "o", "rms_post", "gate_up", "silu", "down"]
tsc = 2.596e9; T = seqs * length
print(f"{seqs} x {length}: step median {statistics.median(total)*1e3:.1f} ms")
for i, nme in enumerate(names):
    ms = (buf[i] - buf0[i]) / tsc / steps * 1e3
    print(f"  {nme:10s} {ms:8.2f} ms/step  {ms*1e3/T:7.3f} us/token")
