"""The offline ShareGPT run (as run_vs_openvino.sh runs kvloom) with the time of every garbage collection recorded."""
import gc, time
from pathlib import Path
from kvloom.bench import datasets
from kvloom.bench.offline import run_offline, warm_up
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
engine = LLMEngine(EngineConfig.from_kwargs(str(Path.home() / "kvloom-peers/models/smollm2-135m-instruct"), dtype="bfloat16",
                                            kv_cache_memory=4, max_num_seqs=256))
requests = datasets.load_token_workload(Path.home() / "kvloom-peers/workloads/sharegpt200.jsonl", 200)
warm_up(engine)
log = []; start = {}
def cb(phase, info):
    if phase == "start": start["t"] = time.perf_counter()
    else: log.append((info["generation"], time.perf_counter() - start["t"], info["collected"]))
gc.callbacks.append(cb)
result = run_offline(engine, requests, "continuous", show_progress=False)
gc.callbacks.remove(cb)
print(f"{result.output_tokens} tokens in {result.elapsed_s:.1f} s ({result.output_throughput:.1f} tok/s)")
for g in range(3):
    ts = [t for gen, t, _ in log if gen == g]
    if ts: print(f"gen {g}: {len(ts)} collections, {sum(ts)*1e3:.1f} ms total, max {max(ts)*1e3:.2f} ms")
print("objects tracked", len(gc.get_objects()))
