import sys, time; sys.path.insert(0,'tests')
from helpers_models import default_model_path
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.bench.structured import review_prompts, run_batch, REVIEW_SCHEMA
from kvloom.structured.tool_grammar import auto_tool_call_constraint
def tagged_constraint(schema):
    return auto_tool_call_constraint([{"type": "function", "function": {"name": "review", "parameters": schema, "strict": True}}], "hermes")
from kvloom import SamplingParams
engine = LLMEngine(EngineConfig.from_kwargs(str(default_model_path())))
prompts = review_prompts(engine, 16)
run_batch(engine, prompts, SamplingParams(max_tokens=1))
c = tagged_constraint(REVIEW_SCHEMA)
run_batch(engine, prompts[:1], SamplingParams(max_tokens=4, structured=c))
res = {"free": [], "tagged": []}
for r in range(4):
    for mode in ("free", "tagged") if r % 2 == 0 else ("tagged", "free"):
        t = time.perf_counter()
        run_batch(engine, prompts, SamplingParams(max_tokens=128, structured=c if mode == "tagged" else None))
        res[mode].append(time.perf_counter() - t)
for k, v in res.items(): print(k, " ".join(f"{x:.2f}" for x in v), "median", sorted(v)[len(v)//2])
