"""How the ranks of a tensor-parallel engine start and agree.

Two ways in, one code path after:

- **spawned** (one host, the default): rank 0 is the process that built the engine;
  it picks a free loopback port and starts ranks 1..N-1 as child processes (daemonic:
  they die with it), each entering ``worker`` with its ``RankPlacement``. They are
  forked from multiprocessing's forkserver, a clean process that has imported torch and
  the worker's modules once (``_rank_context``): a second engine in the same process
  starts its ranks without the ~2 s import each; like ``spawn``'s, each child still
  imports the parent's main module anew;
- **torchrun** (any number of hosts): every rank runs the same command; ranks and the
  rendezvous come from torchrun's environment (``env://``). Rank 0 serves, the others
  enter the worker loop (kvloom/cli.py asks ``torchrun_placement`` first).

Every rank then loads its shard on its own and all of them meet once in ``agree``:
each reports its error (if any), what it loaded and how many KV blocks fit in its
memory, and every rank raises the same message naming the first rank that failed or
differs. So a bad configuration fails at start, on every rank, never as a hang.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for
from typing import Any

import torch

from kvloom.config import EngineConfig
from kvloom.distributed.errors import RankFailed
from kvloom.distributed.group import TensorParallelGroup
from kvloom.ports import reserve_ports

logger = logging.getLogger(__name__)

# The control group's timeout: rank 0's step messages may be days apart (an idle
# server); dead ranks are noticed by their closed sockets, not by this.
_CONTROL_TIMEOUT = datetime.timedelta(days=30)


# This process's thread count and core affinity before join_group placed it.
_placed_before: list[tuple[int, set[int] | None]] = []


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank sits: ``rank`` of ``size``, ``local_rank`` on its host (its CUDA
    device), ``local_size`` ranks on the host (they share its cores), and the
    rendezvous every rank of the group passes to ``init_process_group``."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    init_method: str
    cores: tuple[int, ...] | None = None  # CPU cores this rank is pinned to (spawned ranks)


def torchrun_placement() -> RankPlacement | None:
    """This process's placement when torchrun started it (its environment), else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return None
    env = os.environ
    return RankPlacement(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]),
                         int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])), "env://")


def rank_device(device: torch.device, placement: RankPlacement) -> torch.device:
    """A CUDA rank uses the GPU of its local rank; CPU ranks share the host."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", placement.local_rank)
    return device


def spawn_workers(config: EngineConfig, worker: Callable[[EngineConfig, RankPlacement], None]
                  ) -> tuple[RankPlacement, list[Any]]:
    """Rank 0's placement, and ranks 1..N-1 started as child processes running
    ``worker(config, placement)``. Each rank is pinned to its share of this process's
    cores (on 2 cores with 2 ranks: one each), so the ranks' thread pools do not
    contend for the same core."""
    size = config.parallel.tensor_parallel_size
    (port,) = reserve_ports(1)  # rank 0's TCP store binds it; kept from the kernel's choices meanwhile
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    share = len(cores) // size

    def placement(rank: int) -> RankPlacement:
        pinned = tuple(cores[rank * share:(rank + 1) * share]) if share else None
        return RankPlacement(rank, size, rank, size, f"tcp://127.0.0.1:{port}", pinned)

    context = _rank_context()
    processes, started = [], []
    for rank in range(1, size):
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(target=_entered, args=(worker, writer, config, placement(rank)), daemon=True,
                                  name=f"kvloom-tp-rank{rank}")
        process.start()
        writer.close()  # the child holds its own copy: its end closing is the child's death
        processes.append(process)
        started.append(reader)
    try:
        _await_entered(processes, started, config.parallel.distributed_timeout)
    except BaseException:
        for process in processes:
            process.terminate()
        raise
    return placement(0), processes


def _rank_context() -> Any:
    """multiprocessing's forkserver, its server importing torch and the ranks' code before
    it forks any: a fork of a process that has run no thread pool (what ``spawn`` gives,
    without the imports each time). The server starts at the first engine's ranks and
    keeps the environment it had then."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "kvloom.runner.tensor_parallel"])
    return context


def _entered(worker: Callable[[EngineConfig, RankPlacement], None], started: Connection, config: EngineConfig,
             placement: RankPlacement) -> None:
    """A spawned rank's entry: it says it got past multiprocessing's start, then works."""
    started.send(placement.rank)
    started.close()
    worker(config, placement)


def _await_entered(processes: list[Any], started: list[Connection], timeout_s: float) -> None:
    """Until every spawned rank has entered its worker. One that dies first (in
    multiprocessing's start: a script that builds an engine at its top level, unguarded,
    which spawn re-runs in the child) fails the start now, naming it; rank 0 would
    otherwise wait out ``distributed_timeout`` at the rendezvous."""
    waiting = dict(zip(started, processes, strict=True))
    deadline = time.monotonic() + timeout_s
    while waiting:
        for ready in wait_for(list(waiting), timeout=max(0.0, deadline - time.monotonic())):
            assert isinstance(ready, Connection)
            process = waiting.pop(ready)
            try:
                ready.recv()
            except EOFError:  # its end closed with nothing sent: the process is gone
                process.join()
                raise RankFailed(
                    f"tensor-parallel rank {process.name.removeprefix('kvloom-tp-rank')} exited with status "
                    f"{process.exitcode} before it started (its error is above); a script that builds an "
                    "engine with tensor_parallel_size > 1 must do so under `if __name__ == \"__main__\":`, "
                    "since the ranks' processes import it again") from None
            finally:
                ready.close()
        if waiting and time.monotonic() >= deadline:
            raise RankFailed(f"{len(waiting)} tensor-parallel rank(s) did not start within {timeout_s:g} s")


def join_group(config: EngineConfig, placement: RankPlacement, device: torch.device) -> TensorParallelGroup:
    """Initialise torch.distributed for this rank and return its group (after placing
    its threads: ``num_threads``, else the host's cores shared among its ranks)."""
    import torch.distributed as dist

    # Rank 0 may be a process with a life of its own (a script, the test suite): what
    # this changes is put back by leave_group.
    _placed_before.append((torch.get_num_threads(),
                           os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None))
    if placement.cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, placement.cores)
    cores = len(placement.cores or ()) or max(1, (os.cpu_count() or 1) // placement.local_size)
    torch.set_num_threads(config.num_threads or cores)
    parallel = config.parallel
    backend = parallel.distributed_backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=placement.init_method, rank=placement.rank,
                            world_size=placement.size,
                            timeout=datetime.timedelta(seconds=parallel.distributed_timeout))
    # The control group is gloo on every device: its messages are small host tensors.
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    shm = (_shared_memory(placement, parallel.distributed_timeout, control)
           if device.type == "cpu" and placement.local_size == placement.size and parallel.shared_memory else None)
    return TensorParallelGroup(placement.rank, placement.size, device, dist.group.WORLD, control, shm,
                               expert_parallel=parallel.enable_expert_parallel)


def _shared_memory(placement: RankPlacement, timeout: float, control: Any) -> Any:
    """The shared-memory collectives of ranks that all run on this host: rank 0 makes
    the region and sends its path; once every rank has mapped it, rank 0 removes the
    file (nothing is left in /dev/shm whatever happens next). None where the C++
    source does not build: gloo then carries the steps."""
    import torch.distributed as dist

    from kvloom.distributed import shm

    if not shm.available():
        logger.warning("shared-memory collectives do not build here: tensor parallel steps use gloo")
        return None
    path = shm.create_region(placement.size) if placement.rank == 0 else None
    try:
        paths: list[Any] = [path]
        dist.broadcast_object_list(paths, src=0, group=control)
        collectives = shm.SharedMemoryCollectives(shm.map_region(str(paths[0]), placement.size), placement.rank,
                                                  placement.size, shm.DEFAULT_SLOT_BYTES, timeout)
        dist.barrier(group=control)
    finally:
        if path is not None:  # mapped by every rank now, or never will be
            shm.remove_region(path)
    return collectives


def agree(group: TensorParallelGroup, report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``report`` (rank order), once all have arrived. ``report["error"]``
    is a rank's startup error or None; the other keys must be equal on every rank,
    except ``num_blocks`` (what fits in the rank's memory: the group takes the least).
    Raises RankFailed on every rank when any rank failed or differs."""
    if group.size == 1:
        return [report]
    import torch.distributed as dist

    reports: list[Any] = [None] * group.size
    dist.all_gather_object(reports, report, group=group.control_group)
    for rank, other in enumerate(reports):
        if other.get("error"):
            raise RankFailed(f"tensor-parallel rank {rank} of {group.size} failed to start: {other['error']}")
    first = reports[0]
    for rank, other in enumerate(reports[1:], start=1):
        for key, value in first.items():
            if key not in ("error", "num_blocks") and other.get(key) != value:
                raise RankFailed(f"tensor-parallel rank {rank} was started with a different {key}: "
                                 f"{other.get(key)!r}, rank 0 has {value!r}")
    return reports


def leave_group(group: TensorParallelGroup | None, processes: list[Any], timeout: float = 30.0) -> None:
    """Tear this rank's group down; rank 0 also waits for the ranks it spawned (and
    terminates any that do not exit within ``timeout`` seconds)."""
    import torch.distributed as dist

    if group is not None and group.shm is not None:
        group.shm.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    while _placed_before:
        threads, affinity = _placed_before.pop()
        torch.set_num_threads(threads)
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
    for process in processes:
        process.join(timeout)
        if process.is_alive():
            logger.warning("tensor-parallel %s did not exit: terminating it", process.name)
            process.terminate()
            process.join(5)
