"""Decode steps over varied contexts with the two walks' KV fetch off, in batch order, and in the
attention's order (longest first), alternating in one process (alternate.py).
    PYTHONPATH=/tmp/s13/ab .venv/bin/python docs/results/issue17/genoa13/kv_order_steps.py BATCH ROUNDS LO HI
(/tmp/s13/ab: a worktree with fetch_order_and_offset_tried.patch applied)"""
import random
import sys

from alternate import alternate, decoding_engine, report, worktree

worktree("/tmp/s13/ab")
import kvloom.models.decoder_stack as stack  # noqa: E402
from kvloom import native  # noqa: E402

batch, rounds, lo, hi = (int(v) for v in sys.argv[1:5])
lib = native.load("decoder_stack")


def fetch(mib: int, longest_first: int):  # type: ignore[no-untyped-def]
    def apply() -> None:
        stack.KV_PREFETCH_BYTES = mib << 20
        lib.kvloom_stack_set_sorted(longest_first)
    return apply


settings = {"off": fetch(0, 0), "batch order 8 MiB": fetch(8, 0), "longest first 8 MiB": fetch(8, 1),
            "longest first 12 MiB": fetch(12, 1)}
lengths = [random.Random(1).randrange(lo, hi) for _ in range(batch)]
engine = decoding_engine(lengths, rounds, len(settings))
report(f"batch {batch} contexts {lo}-{hi}", alternate(engine, settings, rounds))
