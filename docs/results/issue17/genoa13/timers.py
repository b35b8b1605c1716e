"""What the instrumented build counts (stack_timers.patch applied in a worktree at /tmp/s13/wt,
run with it on PYTHONPATH): the TSC cycles of each kernel of decoder_stack.cpp's walk, summed per
thread of the outer region (walk 1; walk 2 where a step splits). Used by stack_times.py,
prompt_times.py and prompt_kernels.py."""

from __future__ import annotations

import ctypes
import time

import kvloom
from kvloom import native
from kvloom.engine.engine import LLMEngine

KERNELS = ["rms_in", "qkv", "rotary", "write_kv", "attention", "o", "rms_post", "gate_up", "silu", "down"]
TSC_HZ = 2.596e9  # this VM's TSC (dmesg: "tsc: Detected 2596.150 MHz processor")


class StackTimers:
    def __init__(self) -> None:
        assert "/tmp/s13/wt" in kvloom.__file__, f"run with PYTHONPATH=/tmp/s13/wt (kvloom is {kvloom.__file__})"
        self._lib = native.load("decoder_stack")
        self._before = self._read()

    def _read(self) -> list[int]:
        counts = (ctypes.c_uint64 * 32)()
        self._lib.kvloom_stack_times(counts)
        return list(counts)

    def start(self) -> None:
        self._before = self._read()

    def stop(self, steps: int) -> dict[str, tuple[float, float]]:
        """Each kernel's ms a step since start(), over `steps` steps: (walk 1, walk 2)."""
        after = self._read()

        def ms(index: int) -> float:
            return (after[index] - self._before[index]) / TSC_HZ / steps * 1e3
        return {name: (ms(i), ms(16 + i)) for i, name in enumerate(KERNELS)}


def timed_steps(engine: LLMEngine, steps: int) -> list[float]:
    """Seconds of each of `steps` engine steps."""
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - start)
    return seconds
