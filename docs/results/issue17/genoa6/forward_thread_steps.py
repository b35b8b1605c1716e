import sys, time, random, statistics
import torch
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import SamplingParams
from kvloom.models.default_model import resolve_default_model
batch = int(sys.argv[1]); steps = int(sys.argv[2]); modes = sys.argv[3].split(",")
engines = {m: LLMEngine(EngineConfig.from_kwargs(str(resolve_default_model()), dtype="bfloat16", enable_prefix_caching=False,
                max_num_seqs=256, num_blocks=3000, overlap_scheduling=m)) for m in modes}
res = {}
for rnd in range(2):
  for m, eng in engines.items():
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + 20, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        eng.add_request([rng.randrange(10, 40000) for _ in range(300)], params)
    toks = {}
    while True:
        outs = eng.step()
        if len(outs) == batch and all(o.outputs[0].token_ids for o in outs): break
    for _ in range(3): eng.step()
    total = []
    for _ in range(steps):
        t = time.perf_counter(); outs = eng.step(); total.append(time.perf_counter() - t)
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished: toks[o.request_id] = tuple(o.outputs[0].token_ids)
    res.setdefault(m, []).append(statistics.median(total) * 1e3)
    print(f"round {rnd} {m}: b{batch} median {statistics.median(total)*1e3:.2f} ms, tokens hash {hash(tuple(sorted(toks.values())))}", flush=True)
