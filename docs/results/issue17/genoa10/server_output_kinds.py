"""The server's output kinds end to end: the same requests through one live server
(`kvloom.server.background`, the engine settings of `kvloom serve` on the HF directory
in bf16), answered as full responses or streamed, with the server's per-step outputs
as it now asks for them (full: FINAL_ONLY, streamed: DELTA) and as before this change
(CUMULATIVE for both), alternating in one process. Prints wall seconds, output tokens
per second and the CPU seconds of the engine thread and of the event loop's thread.

    .venv/bin/python docs/results/issue17/genoa10/server_output_kinds.py [NUM] [CONCURRENCY] [ROUNDS]

NUM requests of ~/kvloom-peers/workloads/sharegpt200.jsonl (token ids, its max_tokens,
ignore_eos), CONCURRENCY in flight at once.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from kvloom.bench import datasets
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import RequestOutputKind
from kvloom.server import generation
from kvloom.server.background import start_background_server
from kvloom.server.settings import ServerSettings

MODEL = Path.home() / "kvloom-peers/models/smollm2-135m-instruct"
NEW_KIND = generation.output_kind


def thread_cpu(native_id: int) -> float:
    fields = open(f"/proc/self/task/{native_id}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one(client: httpx.AsyncClient, request, stream: bool) -> int:
    body = {"model": "m", "prompt": request.prompt_token_ids, "max_tokens": request.expected_output_len,
            "ignore_eos": True, "temperature": 0.0, "stream": stream}
    if not stream:
        response = await client.post("/v1/completions", json=body)
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]
    body["stream_options"] = {"include_usage": True}
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"usage":{' in line:
                tokens = int(line.split('"completion_tokens":')[1].split(",")[0])
    return tokens


async def run(base_url: str, requests, stream: bool, concurrency: int) -> int:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        async def guarded(request):
            async with limit:
                return await one(client, request, stream)
        return sum(await asyncio.gather(*(guarded(r) for r in requests)))


def main() -> None:
    num = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    concurrency = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    requests = datasets.load_token_workload(Path.home() / "kvloom-peers/workloads/sharegpt200.jsonl", num)
    config = EngineConfig.from_kwargs(str(MODEL), dtype="bfloat16", max_num_seqs=256)
    server = start_background_server(lambda: LLMEngine(config), ServerSettings(served_model_name="m"))
    engine_thread = server.async_engine._thread
    assert engine_thread is not None and engine_thread.native_id is not None
    loop_thread = server.thread.native_id
    asyncio.run(run(server.base_url, requests, False, concurrency))  # warm up: every batch size once
    results: dict[str, list[tuple[float, int, float, float]]] = {}
    for round_index in range(rounds):
        for stream in (False, True):
            variants = [("now", NEW_KIND), ("cumulative", lambda stream: RequestOutputKind.CUMULATIVE)]
            for name, kind in (variants if round_index % 2 == 0 else variants[::-1]):
                generation.output_kind = kind  # base_params looks it up at each request
                cpu = (thread_cpu(engine_thread.native_id), thread_cpu(loop_thread))
                start = time.perf_counter()
                tokens = asyncio.run(run(server.base_url, requests, stream, concurrency))
                wall = time.perf_counter() - start
                server.assert_idle_and_clean()
                used = (thread_cpu(engine_thread.native_id) - cpu[0], thread_cpu(loop_thread) - cpu[1])
                key = f"{'streamed' if stream else 'full'} {name}"
                results.setdefault(key, []).append((wall, tokens, *used))
                print(f"round {round_index} {key:20s} {wall:7.2f} s {tokens / wall:7.1f} tok/s "
                      f"engine thread {used[0]:6.2f} s cpu, event loop {used[1]:6.2f} s cpu", flush=True)
    print("medians:")
    for key, rows in results.items():
        engine_cpu, loop_cpu = statistics.median(r[2] for r in rows), statistics.median(r[3] for r in rows)
        print(f"  {key:20s} {statistics.median(r[1] / r[0] for r in rows):7.1f} tok/s, event loop "
              f"{loop_cpu:6.2f} s cpu, engine thread {engine_cpu:6.2f} s")
    server.stop()


if __name__ == "__main__":
    main()
