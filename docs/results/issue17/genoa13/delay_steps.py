"""Split decode steps with the second walk started DELAY us after the first (the walks out of
phase), alternating in one process (alternate.py).
    PYTHONPATH=/tmp/s13/ab .venv/bin/python docs/results/issue17/genoa13/delay_steps.py BATCH ROUNDS LO HI D1 D2 ...
(/tmp/s13/ab: a worktree with fetch_order_and_offset_tried.patch applied)"""
import random
import sys

from alternate import alternate, decoding_engine, report, worktree

worktree("/tmp/s13/ab")
from kvloom import native  # noqa: E402

batch, rounds, lo, hi = (int(v) for v in sys.argv[1:5])
lib = native.load("decoder_stack")
settings = {f"delay {d} us": (lambda d=d: lib.kvloom_stack_set_delay(d)) for d in (int(v) for v in sys.argv[5:])}
rng = random.Random(1)
engine = decoding_engine([rng.randrange(lo, hi + 1) for _ in range(batch)], rounds, len(settings))
report(f"batch {batch} contexts {lo}-{hi}", alternate(engine, settings, rounds))
