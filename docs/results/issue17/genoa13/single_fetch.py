"""Decode steps of one walk with the KV fetch on (the MiB given) and off, alternating in one
process (alternate.py).
    PYTHONPATH=/tmp/s13/ab .venv/bin/python docs/results/issue17/genoa13/single_fetch.py BATCH ROUNDS CTX MIB ...
(/tmp/s13/ab: a worktree with fetch_order_and_offset_tried.patch applied)"""
import sys

from alternate import alternate, decoding_engine, report, worktree

worktree("/tmp/s13/ab")
import kvloom.models.decoder_stack as stack  # noqa: E402

batch, rounds, ctx = (int(v) for v in sys.argv[1:4])


def fetch(mib: float):  # type: ignore[no-untyped-def]
    def apply() -> None:
        stack.SINGLE_WALK_PREFETCH = int(mib * (1 << 20))
    return apply


settings = {f"fetch {mib:4.1f} MiB": fetch(mib) for mib in [0.0] + [float(v) for v in sys.argv[4:]]}
engine = decoding_engine([ctx] * batch, rounds, len(settings))
report(f"batch {batch} context {ctx} one walk,", alternate(engine, settings, rounds))
