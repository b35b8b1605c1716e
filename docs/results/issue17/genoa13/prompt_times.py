"""Per-kernel time inside the native decoder stack for the ShareGPT run's first prompt steps
(2,048 tokens each). usage: PYTHONPATH=/tmp/s13/wt python prompt_times.py STEPS"""
import sys, time, statistics, ctypes
from pathlib import Path
import kvloom, kvloom.native as native
assert "/tmp/s13/wt" in kvloom.__file__, kvloom.__file__
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import SamplingParams
from kvloom.bench import datasets
from kvloom.bench.offline import warm_up
steps = int(sys.argv[1])
model = str(Path.home() / "kvloom-peers/models/smollm2-135m-instruct")
eng = LLMEngine(EngineConfig.from_kwargs(model, dtype="bfloat16", kv_cache_memory=4, max_num_seqs=256,
                                         enable_prefix_caching=False))
reqs = datasets.load_token_workload(Path.home() / "kvloom-peers/workloads/sharegpt200.jsonl", 200)
warm_up(eng)
for r in reqs:
    eng.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.expected_output_len, temperature=0.0, ignore_eos=True))
lib = native.load("decoder_stack")
buf = (ctypes.c_uint64 * 32)(); buf0 = (ctypes.c_uint64 * 32)()
eng.step()  # one untimed
lib.kvloom_stack_times(buf0)
total = []
for _ in range(steps):
    t = time.perf_counter(); eng.step(); total.append(time.perf_counter() - t)
lib.kvloom_stack_times(buf)
names = ["rms_in", "qkv", "rotary", "write_kv", "attention", "o", "rms_post", "gate_up", "silu", "down"]
tsc = 2.596e9
print(f"step median {statistics.median(total)*1e3:.1f} ms, mean {statistics.mean(total)*1e3:.1f}")
s = 0
for i, nme in enumerate(names):
    ms = (buf[i] - buf0[i]) / tsc / steps * 1e3; s += ms
    print(f"  {nme:10s} {ms:8.2f} ms/step")
print(f"  sum        {s:8.2f}")
