"""The tensor-parallel group: which rank this process is, and the collectives the
sharded model calls (``all_reduce`` after a row-parallel matmul, ``gather_to_first``
for the vocabulary-parallel output head).

A group of size 1 is the single-process engine: every collective is the identity and
no ``torch.distributed`` state exists, so the one model code serves both. Every
collective is timed and its bytes counted (``CommStats``), which is how
docs/benchmarks.md measures what tensor parallel costs per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvloom.distributed.shm import SharedMemoryCollectives


@dataclass
class CommStats:
    """Cumulative collectives since start: calls, payload bytes (what this rank hands
    to the collective), seconds spent inside them."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, tensor: torch.Tensor, started: float) -> None:
        self.add_counts(1, tensor.numel() * tensor.element_size(), time.perf_counter() - started)

    def add_counts(self, calls: int, sent: int, seconds: float) -> None:
        """Collectives run elsewhere (the native decoder stack's all-reduces)."""
        self.calls += calls
        self.bytes += sent
        self.seconds += seconds


@dataclass(frozen=True)
class TensorParallelGroup:
    """This process's place among the ``size`` ranks that shard one model.

    ``process_group`` carries the step's collectives (with the configured timeout: a
    rank stuck mid-step makes the others fail rather than hang); ``control_group``
    carries only rank 0's step messages (no practical timeout: an idle engine sends
    none for as long as it is idle). With ``shm`` (the ranks of one CPU host), the
    steps' collectives go through shared memory instead, with the same two timeouts.
    A rank that dies is noticed at once: its sockets close (gloo), or its pid is gone
    (shared memory), and every other rank's pending collective fails."""

    rank: int = 0
    size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    process_group: Any = None
    control_group: Any = None
    # Ranks of one host on CPU: every collective of the steps goes through shared
    # memory instead (distributed/shm.py); the process groups then serve the start.
    shm: SharedMemoryCollectives | None = None
    # Mixture-of-experts layers: each rank holds an equal share of whole experts (expert
    # parallel) instead of a share of every expert's features (models/moe.py).
    expert_parallel: bool = False
    stats: CommStats = field(default_factory=CommStats, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.size}")
        if self.size > 1 and self.process_group is None:
            raise ValueError("a tensor-parallel group of more than one rank needs a process group")

    @property
    def is_first(self) -> bool:
        """Rank 0: the one that schedules, samples and talks to clients."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; every rank ends with the same bits
        (each element is reduced once and the result sent to all)."""
        if self.size == 1:
            return tensor
        started = time.perf_counter()
        if self.shm is not None and self.shm.serves(tensor):
            self.shm.all_reduce(tensor)
        else:
            import torch.distributed as dist

            dist.all_reduce(tensor, group=self.process_group)
        self.stats.add(tensor, started)
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's ``tensor`` concatenated along the last dimension, in
        rank order; the other ranks get their own ``tensor`` back (they use none)."""
        if self.size == 1:
            return tensor
        started = time.perf_counter()
        tensor = tensor.contiguous()
        if self.shm is not None and self.shm.serves(tensor):
            parts = self.shm.gather(tensor)
        else:
            import torch.distributed as dist

            parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.is_first else None
            dist.gather(tensor, parts, dst=0, group=self.process_group)
        self.stats.add(tensor, started)
        return torch.cat(parts, dim=-1) if parts is not None else tensor

    def broadcast(self, tensor: torch.Tensor, control: bool = False) -> torch.Tensor:
        """Rank 0's ``tensor`` into every rank's (same shape and dtype), in place;
        ``control``: on the control group (a message that may wait indefinitely)."""
        if self.size == 1:
            return tensor
        started = time.perf_counter()
        if self.shm is not None and self.shm.serves(tensor):
            self.shm.broadcast(tensor, wait_forever=control)
        else:
            import torch.distributed as dist

            dist.broadcast(tensor, src=0, group=self.control_group if control else self.process_group)
        self.stats.add(tensor, started)
        return tensor


SINGLE_PROCESS = TensorParallelGroup()
