"""Issue 24: what the dashboard costs the engine, timed from inside rather than read off
the throughput (which moves 20% between passes on this 2-core machine, see
dashboard_overhead.sh): the time the engine thread spends in LiveStats.on_step, and
the time the event loop spends building the snapshots an open page asks for (5 a
second), against the run's wall time and the engine's steps.

    .venv/bin/python docs/results/issue24/dashboard_cost.py [--num-prompts 200]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

import httpx

from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.server.background import start_background_server
from kvloom.server.dashboard import with_trace
from kvloom.server.live_stats import LiveStats
from kvloom.server.settings import ServerSettings


def timed(owner: object, name: str, totals: dict[str, list[float]]) -> None:
    function = getattr(owner, name)
    totals[name] = [0, 0.0]

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            totals[name][0] += 1
            totals[name][1] += time.perf_counter() - started
    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--max-concurrency", type=int, default=16)
    args = parser.parse_args()
    config = with_trace(EngineConfig())
    engines: list[LLMEngine] = []

    def make_engine() -> LLMEngine:
        engines.append(LLMEngine(config))
        return engines[-1]

    server = start_background_server(make_engine, ServerSettings(served_model_name="smollm2-135m-instruct"))
    live = next(o for o in server.async_engine.observers if isinstance(o, LiveStats))
    totals: dict[str, list[float]] = {}
    timed(live, "on_step", totals)
    timed(live, "snapshot", totals)
    stop = threading.Event()

    def viewer() -> None:  # what the page does: the event stream, 5 messages a second
        with httpx.stream("GET", f"{server.base_url}/dashboard/events?interval=0.2", timeout=None) as stream:
            for _ in stream.iter_lines():
                if stop.is_set():
                    return

    threading.Thread(target=viewer, daemon=True).start()
    started = time.perf_counter()
    steps_before = engines[0].scheduler.step_count
    subprocess.run([sys.executable, "-m", "kvloom", "bench", "serve", "--base-url", server.base_url,
                    "--dataset", "sharegpt", "--num-prompts", str(args.num_prompts), "--max-concurrency",
                    str(args.max_concurrency), "--ignore-eos", "--no-progress"], check=True,
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    steps = engines[0].scheduler.step_count - steps_before
    stop.set()
    server.stop()
    (calls, on_step), (snapshots, snapshot) = totals["on_step"], totals["snapshot"]
    print(f"run {wall:.1f} s, {steps} engine steps ({1000 * wall / steps:.1f} ms a step)")
    print(f"engine thread in LiveStats.on_step: {calls:.0f} calls, {on_step:.3f} s = {100 * on_step / wall:.3f}% "
          f"of the run, {1e6 * on_step / calls:.0f} us a call")
    print(f"event loop building snapshots: {snapshots:.0f} calls, {snapshot:.3f} s = "
          f"{100 * snapshot / wall:.3f}% of the run, {1e6 * snapshot / max(1, snapshots):.0f} us a call")


if __name__ == "__main__":
    main()
