"""Decode steps of a --role decode engine after its requests' KV arrived by the shared-memory
transport (pulled on its kv-import thread): batch 16, prompts of 300 tokens, the default model."""
import sys, time, random, statistics, tempfile
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.kv_spec import KVExport, KVImport, StagedKV
from kvloom.sampling_params import SamplingParams
from kvloom.models.default_model import resolve_default_model
shm = tempfile.mkdtemp(dir="/dev/shm")
model = str(resolve_default_model())
def make(role):
    return LLMEngine(EngineConfig.from_kwargs(model, dtype="bfloat16", role=role, kv_shm_dir=shm, num_blocks=1500,
                                              max_num_seqs=256, enable_prefix_caching=False))
producer, consumer = make("prefill"), make("decode")
rng = random.Random(0)
prompts = {f"r{i}": [rng.randrange(10, 40000) for _ in range(300)] for i in range(16)}
for rid, p in prompts.items():
    producer.add_request(p, SamplingParams(max_tokens=1), request_id=rid, kv_transfer=KVExport())
staged = {}
while producer.has_unfinished_requests():
    for o in producer.step():
        if o.finished: staged[o.request_id] = StagedKV.from_dict(o.kv_transfer_params)
for rid, p in prompts.items():
    consumer.add_request(p, SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True), request_id=rid,
                         kv_transfer=KVImport(staged[rid]))
for _ in range(30): consumer.step()  # the pulls land, the first tokens come
times = []
for _ in range(60):
    t = time.perf_counter(); consumer.step(); times.append(time.perf_counter() - t)
print(f"{sys.argv[1]}: decode b16 after import, median {statistics.median(times)*1e3:.2f} ms, imports {consumer.stats().kv_imports}")
producer.shutdown(); consumer.shutdown()
