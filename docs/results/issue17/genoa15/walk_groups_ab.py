"""Decode steps with each split walk's sequences in groups that take turns layer by layer, each group's
KV of a layer at most N bytes (walk_groups_tried.patch applied; KVLOOM_WALK_GROUP_BYTES, read each call),
alternating in one process.  .venv/bin/python walk_groups_ab.py BATCH ROUNDS CTX"""
import os, sys
sys.path.insert(0, "docs/results/issue17/genoa13")
from alternate import alternate, decoding_engine, report
batch, rounds, ctx = (int(v) for v in sys.argv[1:4])
def setting(v):
    def apply(): os.environ["KVLOOM_WALK_GROUP_BYTES"] = str(v)
    return apply
settings = {"whole walks": setting(0), "groups of 8 MiB": setting(8 << 20), "groups of 4 MiB": setting(4 << 20),
            "groups of 12 MiB": setting(12 << 20)}
engine = decoding_engine([ctx] * batch, rounds, len(settings))
report(f"batch {batch} context {ctx}", alternate(engine, settings, rounds))
