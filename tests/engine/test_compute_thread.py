"""The thread that computes for an engine on a CPU: stepping it from another thread is
said once per move (libgomp then runs two teams and throttles both), and hand_over()
releases the old thread's OpenMP team so that the new one takes over silently."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvloom import SamplingParams
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.native import loaded_openmp, release_openmp_team

WARNING = "not on the thread that built the engine"


@pytest.fixture
def engine(tiny_llama) -> LLMEngine:
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_llama), dtype="float32", num_blocks=64))
    engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    return engine


def on_thread(fn: Callable[[], object]) -> None:
    """Run fn on a new thread and wait for it (its exception re-raised here)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and WARNING in r.getMessage()]


def test_stepping_on_another_thread_is_said_once_per_move(engine, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="kvloom.engine.engine")
    engine.step()
    assert warnings_of(caplog) == []
    on_thread(lambda: [engine.step() for _ in range(3)])
    assert len(warnings_of(caplog)) == 1
    engine.step()  # and back: another move
    assert len(warnings_of(caplog)) == 2


def test_the_runtime_released_is_the_one_torch_runs_on() -> None:
    import sentencepiece  # noqa: F401 - it brings its own, renamed libgomp (found first by path)

    library = loaded_openmp()
    assert library is not None
    address = ctypes.cast(library.omp_pause_resource_all, ctypes.c_void_p).value
    torch_lib = Path(torch.__file__).parent / "lib"
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            assert Path(fields[-1]).parent == torch_lib, fields[-1]
            return
    raise AssertionError("omp_pause_resource_all is in no mapped file")


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_hand_over_releases_the_team_and_the_next_thread_takes_over_silently(engine, caplog, two_threads) -> None:
    caplog.set_level(logging.WARNING, logger="kvloom.engine.engine")
    engine.step()
    assert loaded_openmp() is not None  # torch's libgomp: what kvloom's kernels run on
    torch.ones(1 << 22).add_(1)  # a parallel region on this thread: its team exists now
    before = threads()
    engine.hand_over()
    after = threads()
    assert after < before  # the team's worker threads exited (joined)
    assert release_openmp_team() and threads() == after  # nothing left to release
    done: list[bool] = []
    on_thread(lambda: done.append(all(engine.step() is not None for _ in range(3))))
    assert done == [True]
    assert warnings_of(caplog) == []
