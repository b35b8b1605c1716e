"""``@function`` programs: ``run`` one, ``run_batch`` many at once."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvloom.lang.backend import Backend
from kvloom.lang.errors import LangError
from kvloom.lang.state import ProgramState

_default_backend: Backend | None = None


def set_default_backend(backend: Backend) -> None:
    global _default_backend
    _default_backend = backend


def _backend(backend: Backend | None) -> Backend:
    chosen = backend if backend is not None else _default_backend
    if chosen is None:
        raise LangError("no backend: call kvloom.lang.set_default_backend(kl.Local(LLM())) or pass backend=")
    return chosen


class Function:
    """A program: ``fn(s, *args, **kwargs)`` appends to the state ``s``."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def run(self, *args: Any, backend: Backend | None = None, stream: bool = False, **kwargs: Any) -> ProgramState:
        """Run the program to its end (``stream``: in the background; read
        ``state.text_stream()``, then the variables). Errors are raised here."""
        state = ProgramState(_backend(backend))
        if stream:
            threading.Thread(target=self._run, args=(state, args, kwargs, True), daemon=True).start()
            return state
        self._run(state, args, kwargs, False)
        return state

    def _run(self, state: ProgramState, args: Sequence[Any], kwargs: Mapping[str, Any], background: bool) -> None:
        """In the background, an error stays in the state: reading it raises it."""
        try:
            self.fn(state, *args, **kwargs)
        except BaseException:
            with contextlib.suppress(BaseException):  # the program's own error is the one to see
                state.finish()
            if not background:
                raise
            return
        try:
            state.finish()
        except BaseException:
            if not background:
                raise

    def run_batch(self, batch: Sequence[Mapping[str, Any]], backend: Backend | None = None,
                  num_threads: int = 64) -> list[ProgramState]:
        """Run the program once per keyword set, concurrently: their generations share
        the engine's batch. States in input order; the first error is raised."""
        chosen = _backend(backend)
        with ThreadPoolExecutor(max_workers=max(1, min(num_threads, len(batch)))) as pool:
            return list(pool.map(lambda kwargs: self.run(backend=chosen, **kwargs), batch))

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)


def function(fn: Callable[..., None]) -> Function:
    return Function(fn)
