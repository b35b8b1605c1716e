"""Collectives through shared memory, for the tensor-parallel ranks of one host.

gloo's collectives cost 1-2 ms each on a small VM (a TCP round trip plus hand-offs
between gloo's threads), and a decode step makes two per layer: more than the
layers' own compute. Ranks on one host instead share one memory region
(a file in /dev/shm that each rank maps) and synchronise through per-rank counters in it
(kvloom/csrc/shm_collectives.cpp has the protocol): an all-reduce is a copy in, a
wait for the other ranks, and a sum in rank order in float32 (the same bits on every
rank, and bf16 partial sums are rounded once, not once per rank).

Tensors larger than a slot go through in slot-sized pieces. A rank that dies is
noticed by the ranks waiting for it within milliseconds (they check its pid);
``timeout`` bounds a wait for a rank that lives but never arrives.
"""

from __future__ import annotations

import os
import tempfile

import torch

from kvloom.kernels import shm_collectives as native

# Per rank and parity: a decode step's all-reduce is [batch, hidden]; a 2048-token
# prefill chunk of a 576-wide model in float32 is 4.5 MiB (two pieces).
DEFAULT_SLOT_BYTES = 4 << 20
_ALL_REDUCE_VARIANTS = {torch.float32: "f32", torch.bfloat16: "bf16"}


class ShmCollectiveError(RuntimeError):
    """A shared-memory collective failed: a rank died, or one never arrived."""


class SharedMemoryCollectives:
    """This rank's view of the shared region: all-reduce, broadcast from rank 0 and
    gather to rank 0 of CPU tensors. Every rank must call the same collectives in
    the same order (each is numbered by ``seq``, counted here)."""

    def __init__(self, region: torch.Tensor, rank: int, size: int, slot_bytes: int, timeout: float) -> None:
        self.rank, self.size, self.slot_bytes, self.timeout = rank, size, slot_bytes, timeout
        self.region = region  # the mapping lives as long as this tensor
        self._address = self.region.data_ptr()
        self._header = native.HEADER_BYTES.function()()
        # The state the native decoder stack's all-reduce shares with this object
        # (kernels/shm_collectives.py CONTEXT_FIELDS): above all ``seq``, the number of
        # the last collective, which both advance.
        fields = {"region": self._address, "rank": rank, "size": size, "seq": 0, "slot_bytes": slot_bytes,
                  "timeout_ms": int(timeout * 1000), "calls": 0, "bytes": 0, "nanoseconds": 0}
        self.context = torch.tensor([fields[name] for name in native.CONTEXT_FIELDS], dtype=torch.int64)
        self._seq_index = native.CONTEXT_FIELDS.index("seq")
        self._publish = native.PUBLISH.function()
        self._wait = native.WAIT.function()
        self._done = native.DONE.function()
        self._all_reduce = {dtype: native.ALL_REDUCE.function(variant)
                            for dtype, variant in _ALL_REDUCE_VARIANTS.items()}
        native.JOIN.function()(self._address, rank, os.getpid())

    @property
    def seq(self) -> int:
        """The number of the last collective (every rank's counts the same ones)."""
        return int(self.context[self._seq_index])

    @seq.setter
    def seq(self, value: int) -> None:
        self.context[self._seq_index] = value

    def native_counts(self) -> tuple[int, int, float]:
        """Calls, bytes and seconds of the all-reduces the native decoder stack ran, so far."""
        calls, sent, nanoseconds = self.context[-3:].tolist()
        return calls, sent, nanoseconds / 1e9

    @staticmethod
    def region_bytes(size: int, slot_bytes: int) -> int:
        return int(native.HEADER_BYTES.function()()) + 2 * size * slot_bytes

    def serves(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks in place (float32 and bf16; float16 and others are summed
        in float32 and rounded back)."""
        if tensor.dtype not in self._all_reduce:
            wide = tensor.float()
            self.all_reduce(wide)
            return tensor.copy_(wide)
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        function = self._all_reduce[flat.dtype]
        step = self.slot_bytes // flat.element_size()
        for start in range(0, flat.numel(), step):
            piece = flat[start:start + step]
            seq = self._next_seq()
            self._check(function(self._address, piece.data_ptr(), piece.numel(), self.rank, self.size,
                                 seq, self.slot_bytes, self.timeout), "all-reduce")
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
        return tensor

    def broadcast(self, tensor: torch.Tensor, wait_forever: bool = False) -> torch.Tensor:
        """Rank 0's ``tensor`` into every rank's, in place. ``wait_forever``: no timeout
        (rank 0's next step message may be long in coming; a dead rank still fails it)."""
        flat = self._bytes(tensor)
        timeout = 0.0 if wait_forever else self.timeout
        for start in range(0, flat.numel(), self.slot_bytes):
            piece = flat[start:start + self.slot_bytes]
            seq = self._next_seq()
            mine = piece.numel() if self.rank == 0 else 0
            self._check(self._publish(self._address, piece.data_ptr(), mine, self.rank, self.size, seq,
                                      self.slot_bytes, timeout), "broadcast")
            self._check(self._wait(self._address, self.size, seq, timeout), "broadcast")
            if self.rank != 0:
                piece.copy_(self._slot(seq, 0, piece.numel()))
            self._done(self._address, self.rank, seq)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view(tensor.dtype).view_as(tensor))
        return tensor

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0: every rank's ``tensor`` (same shape and dtype), in rank order; the
        other ranks: None."""
        flat = self._bytes(tensor)
        parts = ([torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else [])
        for start in range(0, flat.numel(), self.slot_bytes):
            piece = flat[start:start + self.slot_bytes]
            seq = self._next_seq()
            self._check(self._publish(self._address, piece.data_ptr(), piece.numel(), self.rank, self.size,
                                      seq, self.slot_bytes, self.timeout), "gather")
            self._check(self._wait(self._address, self.size, seq, self.timeout), "gather")
            for rank, part in enumerate(parts):
                self._bytes(part)[start:start + piece.numel()].copy_(self._slot(seq, rank, piece.numel()))
            self._done(self._address, self.rank, seq)
        return parts if self.rank == 0 else None

    def close(self) -> None:
        """Drop this rank's mapping (unmapped once no view of it is left)."""
        self.region = torch.empty(0, dtype=torch.uint8)
        self._address = 0
        self.context[0] = 0

    # ---- helpers -------------------------------------------------------------------
    @staticmethod
    def _bytes(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_contiguous():
            raise ValueError("shared-memory collectives take contiguous tensors")
        return tensor.view(-1).view(torch.uint8)

    def _next_seq(self) -> int:
        seq = self.seq + 1
        self.seq = seq
        return seq

    def _slot(self, seq: int, rank: int, nbytes: int) -> torch.Tensor:
        start = self._header + ((seq & 1) * self.size + rank) * self.slot_bytes
        return self.region[start:start + nbytes]

    def _check(self, status: int, what: str) -> None:
        if status == -2:
            raise ShmCollectiveError(f"tensor-parallel {what}: another rank of this host died")
        if status == -1:
            raise ShmCollectiveError(f"tensor-parallel {what}: timed out after {self.timeout:g} s waiting "
                                     "for another rank")


def create_region(size: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> str:
    """Rank 0: a new zeroed region for ``size`` ranks, as a file in /dev/shm (memory,
    not disk); its path goes to the other ranks, and rank 0 removes it once every rank
    has mapped it (``remove_region``)."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    handle, path = tempfile.mkstemp(prefix="kvloom-tp-", dir=directory)
    try:
        os.ftruncate(handle, SharedMemoryCollectives.region_bytes(size, slot_bytes))
    finally:
        os.close(handle)
    return path


def map_region(path: str, size: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> torch.Tensor:
    """Every rank: the region as a uint8 tensor over shared pages (``torch.from_file``
    maps it MAP_SHARED: one rank's writes are the others' reads)."""
    return torch.from_file(path, shared=True, size=SharedMemoryCollectives.region_bytes(size, slot_bytes),
                           dtype=torch.uint8)


def remove_region(path: str) -> None:
    os.unlink(path)


def available() -> bool:
    return native.available()
