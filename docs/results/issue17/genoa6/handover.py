"""Usage: .venv/bin/python docs/results/issue17/genoa6/handover.py MODE [BATCH]

Decode steps at batch 16, context 300, of an engine built on the main thread and stepped
on another thread, with or without LLMEngine.hand_over() on the main thread first (argv[1]:
'hand_over', 'no', or 'main' = stepped on the main thread itself)."""
import sys, time, random, statistics, threading
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import SamplingParams
from kvloom.models.default_model import resolve_default_model
mode = sys.argv[1]; batch = int(sys.argv[2]) if len(sys.argv) > 2 else 16
eng = LLMEngine(EngineConfig.from_kwargs(str(resolve_default_model()), dtype="bfloat16", enable_prefix_caching=False,
                                         max_num_seqs=256, num_blocks=3000))
rng = random.Random(0)
for _ in range(batch):
    eng.add_request([rng.randrange(10, 40000) for _ in range(300)], SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True))
if mode == "hand_over":
    eng.hand_over()
times = []
def run():
    for _ in range(6): eng.step()
    for _ in range(80):
        t = time.perf_counter(); eng.step(); times.append(time.perf_counter() - t)
if mode == "main": run()
else:
    th = threading.Thread(target=run); th.start(); th.join()
print(f"{mode}: b{batch} median {statistics.median(times)*1e3:.2f} ms")
