"""Decode steps as one walk, as two walks without the KV fetch, and as two walks fetching
8 MiB of each layer's KV during their matmuls (the engine's choice from 32 sequences on two
threads), alternating in one process (genoa13/alternate.py; MODEL= another checkpoint).
Both rules come from AMD EPYC; on an AMX CPU, whose matmuls are cheaper against the KV
read, they are unmeasured (scripts/amx_host_check.sh runs this there).
    .venv/bin/python docs/results/issue17/genoa15/amx_walks.py BATCH ROUNDS CTX"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "genoa13"))
from alternate import alternate, decoding_engine, report  # noqa: E402

import kvloom.models.decoder_stack as stack  # noqa: E402

batch, rounds, ctx = (int(v) for v in sys.argv[1:4])
ENGINE_SPLIT, ENGINE_FETCH = stack.SPLIT_FROM_TOKENS, stack.KV_PREFETCH_BYTES


def setting(split_from: int, fetch: int):  # type: ignore[no-untyped-def]
    def apply() -> None:
        stack.SPLIT_FROM_TOKENS, stack.KV_PREFETCH_BYTES = split_from, fetch
    return apply


settings = {"one walk": setting(1 << 30, ENGINE_FETCH), "two walks, no fetch": setting(ENGINE_SPLIT, 0),
            "two walks + fetch": setting(ENGINE_SPLIT, ENGINE_FETCH)}
engine = decoding_engine([ctx] * batch, rounds, len(settings))
report(f"batch {batch} context {ctx}", alternate(engine, settings, rounds))
