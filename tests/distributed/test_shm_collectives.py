"""The shared-memory collectives (kvloom/csrc/shm_collectives.cpp) between real
processes: all-reduce against the sum computed here (float32, rank order, one
rounding), broadcast and gather byte for byte, pieces larger than a slot, and the
failures: a rank that dies, a rank that never arrives.
"""

from __future__ import annotations

import io
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

from kvloom.distributed import shm

pytestmark = pytest.mark.skipif(not shm.available(), reason="shm_collectives.cpp does not build here")

SLOT_BYTES = 4096  # small: every tensor below crosses several pieces
SHAPES = [(3, 5), (700, 3), (2, 1500)]  # 15, 2100 and 3000 elements


def rank_data(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + shape[0])
    return (torch.randn(shape, generator=generator) * 3).to(dtype)


def _rank_main(path: str, rank: int, size: int, results: Any, behaviour: str, release: Any) -> None:
    collectives = shm.SharedMemoryCollectives(shm.map_region(path, size, SLOT_BYTES), rank, size, SLOT_BYTES,
                                              timeout=0.5 if behaviour == "timeout" else 30.0)
    if rank == 1 and behaviour == "die":
        raise SystemExit(3)  # joined, then gone without a word
    if rank == 1 and behaviour == "timeout":
        release.wait()  # alive, but never arrives
        return
    try:
        out: dict[str, Any] = {}
        for dtype in (torch.float32, torch.bfloat16):
            for shape in SHAPES:
                out[f"reduce {dtype} {shape}"] = collectives.all_reduce(rank_data(rank, shape, dtype))
        sent = rank_data(rank, (40, 33), torch.float32)
        out["broadcast"] = collectives.broadcast(sent)
        out["gather"] = collectives.gather(rank_data(rank, (17, 129), torch.bfloat16))
        buffer = io.BytesIO()  # tensors pickled as bytes: nothing outlives this process
        torch.save(out, buffer)
        results.put((rank, buffer.getvalue()))
    except shm.ShmCollectiveError as error:
        results.put((rank, str(error)))
    finally:
        release.set()


def run_ranks(tmp_path: Path, size: int, behaviour: str = "") -> dict[int, Any]:
    path = shm.create_region(size, SLOT_BYTES)
    # As the engine's ranks start (distributed/launch.py): forked from a server that has
    # imported torch once, not each rank importing it anew.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "kvloom.distributed.shm"])
    results, release = context.Queue(), context.Event()
    processes = [context.Process(target=_rank_main, args=(path, rank, size, results, behaviour, release))
                 for rank in range(size)]
    try:
        for process in processes:
            process.start()
        reporting = 1 if behaviour else size
        collected = {}
        for _ in range(reporting):
            rank, value = results.get(timeout=60)
            collected[rank] = torch.load(io.BytesIO(value)) if isinstance(value, bytes) else value
        for process in processes:
            process.join(60)
    finally:
        shm.remove_region(path)  # whatever happened: nothing left in /dev/shm
        for process in processes:
            if process.is_alive():
                process.kill()
    return collected


@pytest.mark.parametrize("size", [2, 3])
def test_collectives_match_the_sums_computed_here(tmp_path: Path, size: int) -> None:
    results = run_ranks(tmp_path, size)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            total = torch.zeros(shape, dtype=torch.float32)
            for rank in range(size):
                total += rank_data(rank, shape, dtype).float()
            expected = total.to(dtype)  # one rounding, after the float32 sum in rank order
            for rank in range(size):
                assert torch.equal(results[rank][f"reduce {dtype} {shape}"], expected), (rank, dtype, shape)
    for rank in range(size):
        assert torch.equal(results[rank]["broadcast"], rank_data(0, (40, 33), torch.float32))
    gathered = results[0]["gather"]
    assert [torch.equal(part, rank_data(rank, (17, 129), torch.bfloat16)) for rank, part in enumerate(gathered)] \
        == [True] * size
    assert all(results[rank]["gather"] is None for rank in range(1, size))


def test_a_rank_that_dies_fails_the_others(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, 2, "die")
    assert results[0] == "tensor-parallel all-reduce: another rank of this host died"


def test_a_rank_that_never_arrives_times_out(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, 2, "timeout")
    assert results[0] == "tensor-parallel all-reduce: timed out after 0.5 s waiting for another rank"
