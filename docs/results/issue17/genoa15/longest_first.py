"""The offline ShareGPT-200 run (run_vs_openvino.sh's engine settings) under other schedules, one
run per config, in one process: CONFIGS="fcfs:256:2048 lpt:32:2048 ..." (policy:max_num_seqs:budget).
lpt: the priority policy with priority = -max_tokens, so that the longest requests are admitted
first and the short ones fill the steps beside them, with at most max_num_seqs running.
    CONFIGS="fcfs:256:2048 lpt:32:2048 lpt:48:2048 lpt:64:2048" .venv/bin/python longest_first.py"""
import os, sys, time
from pathlib import Path
from kvloom.bench import datasets
from kvloom.bench.offline import run_offline, warm_up
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
model = str(Path.home() / "kvloom-peers/models/smollm2-135m-instruct")
requests = datasets.load_token_workload(str(Path.home() / "kvloom-peers/workloads/sharegpt200.jsonl"), 200)
for cfg in os.environ["CONFIGS"].split():
    kind, seqs, budget = cfg.split(":")
    engine = LLMEngine(EngineConfig.from_kwargs(model, dtype="bfloat16", kv_cache_memory=4, max_num_seqs=int(seqs),
                       max_num_batched_tokens=int(budget), policy="priority" if kind == "lpt" else "fcfs"))
    warm_up(engine)
    if kind == "lpt":
        add = engine.add_request
        engine.add_request = lambda prompt, params=None, **kw: add(prompt, params, priority=-params.max_tokens, **kw)
    r = run_offline(engine, requests, cfg, show_progress=False)
    print(f"{time.strftime('%H:%M:%S')} {cfg:>16} {r.output_tokens} tok {r.elapsed_s:6.1f} s {r.output_throughput:6.1f} tok/s steps {r.steps} preempt {r.num_preemptions}", flush=True)
    del engine
