"""The torch profiler over the engine's steps (vLLM's ``start_profile`` / ``stop_profile``).

While a profile runs, every op the engine computes is recorded with its input shapes:
torch's, and kvloom's own kernels under their op names (``kvloom::...``, kernels/), on
the CPU, and on the GPU where the engine runs there; each engine step is one
``ProfilerStep#N`` span, so a step's schedule, forward and sampling read in order.
Stopped, the profile is written as a gzipped Chrome trace, which Perfetto
(ui.perfetto.dev) and chrome://tracing open. Off, it costs one attribute check a step.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any

import torch

_TRACES = itertools.count()  # the process's traces, numbered for their file names


class StepProfiler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._profile: Any = None  # a torch.profiler.profile while one runs

    def start(self) -> None:
        """ValueError if a profile runs already."""
        if self._profile is not None:
            raise ValueError("a profile is running already: stop it first")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # A schedule that records every step: given one, torch marks the steps' spans.
        profile = torch.profiler.profile(activities=activities, record_shapes=True,
                                         schedule=lambda step: torch.profiler.ProfilerAction.RECORD)
        profile.start()
        self._profile = profile

    def step(self) -> None:
        """An engine step begins (the last one's span ends)."""
        if self._profile is not None:
            self._profile.step()

    def stop(self) -> Any:
        """Ends the profile: its recording, which ``write_trace`` writes (it takes a while
        for a long profile; a server does it off the engine's thread). ValueError if
        none runs."""
        if self._profile is None:
            raise ValueError("no profile is running: start one first")
        profile, self._profile = self._profile, None
        profile.stop()
        return profile


def write_trace(profile: Any, directory: str | Path) -> Path:
    """A stopped profile's Chrome trace, gzipped, written into ``directory`` (made if
    missing): the file's path."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = folder / f"kvloom-{os.getpid()}-{stamp}-{next(_TRACES)}.pt.trace.json.gz"
    profile.export_chrome_trace(str(path))
    return path
