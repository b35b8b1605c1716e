"""Decode steps as one walk and as two (SPLIT_FROM_TOKENS 32, the engine's, against 2),
alternating in one process (alternate.py); the checkout's own build.
    .venv/bin/python docs/results/issue17/genoa13/split_from.py BATCH ROUNDS CTX"""
import sys

from alternate import alternate, decoding_engine, report

import kvloom.models.decoder_stack as stack

batch, rounds, ctx = (int(v) for v in sys.argv[1:4])


def split_from(tokens: int):  # type: ignore[no-untyped-def]
    def apply() -> None:
        stack.SPLIT_FROM_TOKENS = tokens
    return apply


settings = {"split from 32": split_from(32), "split from 2": split_from(2)}
engine = decoding_engine([ctx] * batch, rounds, len(settings))
report(f"batch {batch} context {ctx}", alternate(engine, settings, rounds))
