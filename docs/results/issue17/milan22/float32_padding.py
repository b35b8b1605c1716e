"""float32 decode steps with the rows padded (Float32Linear) and not (FLOAT32_ROWS_MULTIPLE = 1:
every count kept), alternating in one process; default model, context 300."""
import statistics, sys
import kvloom.models.packed_linear as pl
from kvloom.bench.steps import time_decode
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
model = sys.argv[1]
for batch in (1, 3, 16):
    engine = LLMEngine(EngineConfig.from_kwargs(model, dtype="float32", enable_prefix_caching=False,
                       max_num_seqs=64, num_blocks=batch * 400 // 16 + 64))
    time_decode(engine, batch, 300, 3, seed=99, centred=True)
    res = {4: [], 1: []}
    for r in range(3):
        for multiple in (1, 4):
            pl.FLOAT32_ROWS_MULTIPLE = multiple
            t = time_decode(engine, batch, 300, 20, seed=batch + r, centred=True)
            res[multiple].append(statistics.median(t.milliseconds))
    print(f"fp32 decode b{batch} x 300: plain F.linear {[round(v, 2) for v in res[1]]} ms, padded {[round(v, 2) for v in res[4]]} ms", flush=True)
    engine.shutdown()
