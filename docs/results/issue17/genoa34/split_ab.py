"""Decode at batch 64 and 128 (context 512), two walks (default) against one, alternating in one process."""
import statistics, sys
from pathlib import Path
from kvloom.bench.families import FAMILIES, write_family
from kvloom.bench.steps import time_decode
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.models import decoder_stack as stack_model
from kvloom.models.loader import load_checkpoint
from kvloom.config import DEFAULT_MODEL
tok = load_checkpoint(DEFAULT_MODEL).tokenizer
for family in sys.argv[1].split(","):
    path = write_family(FAMILIES[family], Path("/tmp/kvloom-families") / family, tok)
    engine = LLMEngine(EngineConfig.from_kwargs(str(path), dtype="bfloat16", enable_prefix_caching=False,
                                                max_num_seqs=128, max_num_batched_tokens=2048, num_blocks=128 * 600 // 16 + 64))
    time_decode(engine, 8, 64, 3, seed=99)
    for batch in (64, 128):
        for rnd in range(2):
            for split in (True, False):
                stack_model.SPLIT_FROM_TOKENS = 32 if split else 10**9
                t = time_decode(engine, batch, 512, 8, seed=batch)
                print(f"{family} b{batch} {'two walks' if split else 'one walk '} median {statistics.median(t.milliseconds):.1f} ms", flush=True)
    engine.shutdown()
