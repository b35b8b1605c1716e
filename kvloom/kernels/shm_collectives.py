"""The C side of tensor parallel's shared-memory collectives (kvloom/csrc/shm_collectives.cpp):
the functions kvloom/distributed/shm.py calls on a region every rank of one host maps.

Statuses: 0 done, -1 timed out, -2 a rank waited for has died.
"""

from __future__ import annotations

from kvloom.kernels.native_op import NativeFunction

HEADER_BYTES = NativeFunction("shm_collectives", "kvloom_shm_header_bytes() -> int")
MAX_RANKS = NativeFunction("shm_collectives", "kvloom_shm_max_ranks() -> int")
JOIN = NativeFunction("shm_collectives", "kvloom_shm_join(Tensor region, int rank, int pid) -> ()")
PUBLISH = NativeFunction("shm_collectives", "kvloom_shm_publish(Tensor region, Tensor src, int nbytes, int rank, "
                                            "int size, int seq, int slot_bytes, float timeout) -> int32")
WAIT = NativeFunction("shm_collectives", "kvloom_shm_wait(Tensor region, int size, int seq, float timeout) -> int32")
DONE = NativeFunction("shm_collectives", "kvloom_shm_done(Tensor region, int rank, int seq) -> ()")
ALL_REDUCE = NativeFunction("shm_collectives", "kvloom_shm_all_reduce_{variant}(Tensor region, Tensor data, "
                                               "int numel, int rank, int size, int seq, int slot_bytes, "
                                               "float timeout) -> int32", variants=("f32", "bf16"))

# The decoder stack's all-reduce (csrc/decoder_stack.cpp calls it through its kernel table).
ALL_REDUCE_STACK = NativeFunction("shm_collectives", "kvloom_shm_all_reduce_stack(Tensor context, Tensor data, "
                                                     "int numel) -> int32")
# kvloom_shm_all_reduce_stack's context: its int64 fields, in order.
CONTEXT_FIELDS = ("region", "rank", "size", "seq", "slot_bytes", "timeout_ms", "calls", "bytes", "nanoseconds")


def available() -> bool:
    """Whether shm_collectives.cpp builds here (else the ranks use gloo alone)."""
    return HEADER_BYTES.available()
