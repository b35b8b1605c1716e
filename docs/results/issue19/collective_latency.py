"""Back-to-back all-reduce latency between 2 ranks pinned to one core each: gloo vs kvloom's
shared-memory collectives. Usage: python docs/results/issue19/collective_latency.py"""
import os, sys, time, datetime, socket
import torch, torch.distributed as dist
import multiprocessing as mp
from kvloom.distributed import shm

def run(rank, size, port, path):
    os.sched_setaffinity(0, {rank}); torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    coll = shm.SharedMemoryCollectives(shm.map_region(path, size), rank, size, shm.DEFAULT_SLOT_BYTES, 30.0)
    dist.barrier()
    for n in (576, 576 * 16, 576 * 64, 576 * 512):
        t = torch.ones(n, dtype=torch.bfloat16)
        for name, fn in (("gloo", lambda: dist.all_reduce(t)), ("shm", lambda: coll.all_reduce(t))):
            for _ in range(20): fn()
            dist.barrier()
            t0 = time.perf_counter(); iters = 300
            for _ in range(iters): fn()
            dt = (time.perf_counter() - t0) / iters * 1e6
            if rank == 0: print(f"{name} all_reduce {n*2/1024:.1f} KiB: {dt:.1f} us", flush=True)
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    path = shm.create_region(2)
    p = mp.get_context("spawn").Process(target=run, args=(1, 2, port, path)); p.start()
    run(0, 2, port, path); p.join(); shm.remove_region(path)
