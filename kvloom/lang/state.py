"""A program's state: its text so far, its variables, and the thread that runs what
the program appends to it.

``s += expr`` queues ``expr`` and returns at once; the state's own thread runs the
queue in order against the backend. Reading ``s[name]``, forking, or the end of the
program waits for the queue (a *sync point*) and raises there any error the thread
met. So the forks of a state, each with its own thread, generate concurrently, and
many programs (``run_batch``) share the engine's batch.

The state's thread is the one writer of ``text`` and the variables it produces while
it runs; the program's thread touches them only at sync points.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvloom.lang.backend import Backend
from kvloom.lang.errors import BackendClosed, EngineFault, LangError, caller
from kvloom.lang.expr import Concat, Expr, Gen, Role, Select, Text, as_expr


@dataclass(frozen=True)
class Call:
    """One gen as the program saw it: its prompt, what the prefix cache served, and
    its latency measured on the state's thread (so, for ``Endpoint``, with the HTTP
    round trips a client pays)."""

    name: str | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens the prefix cache served
    first_text_s: float | None  # request to its first piece of text (the TTFT a user sees); None: no text
    seconds: float  # request to the whole answer


class ProgramState:
    def __init__(self, backend: Backend, text: str = "", variables: dict[str, Any] | None = None) -> None:
        self.backend = backend
        self._text = text
        self._variables: dict[str, Any] = dict(variables or {})
        self.select_scores: dict[str, dict[str, float]] = {}  # select name -> choice -> summed logprob
        self.calls: list[Call] = []  # every gen, in order
        self.select_cached_tokens: list[list[int]] = []  # every select's hits, per choice
        self.forks: list[ProgramState] = []
        self._queue: queue.SimpleQueue[Expr | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._queued = 0
        self._ran = 0
        self._error: BaseException | None = None
        self._finished = False
        self._deltas: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvloom-lang-state", daemon=True)
        self._thread.start()

    # ---- the program's side -------------------------------------------------------------
    def __iadd__(self, other: Expr | str) -> ProgramState:
        if self._finished:
            raise LangError("this state's program has finished: nothing more can be appended", caller())
        expr = as_expr(other)
        with self._done:
            self._queued += 1
        self._queue.put(expr)
        return self

    def __getitem__(self, name: str) -> Any:
        where = caller()
        self.sync()
        if name not in self._variables:
            known = ", ".join(sorted(self._variables)) or "none yet"
            raise LangError(f"variable {name!r} is read before anything generated it (known: {known})", where)
        return self._variables[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self.sync()
        self._variables[name] = value

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._variables

    @property
    def text(self) -> str:
        self.sync()
        return self._text

    def variables(self) -> dict[str, Any]:
        self.sync()
        return dict(self._variables)

    def fork(self, n: int) -> list[ProgramState]:
        """``n`` states that continue from this one's text (and variables); their texts
        share it, so the prefix cache computes it once."""
        where = caller()
        if self._finished:
            raise LangError("fork of a finished state: fork inside the program, before it returns", where)
        if not isinstance(n, int) or n < 1:
            raise LangError(f"fork needs a positive number of states, got {n!r}", where)
        self.sync()
        children = [ProgramState(self.backend, self._text, self._variables) for _ in range(n)]
        self.forks.extend(children)
        return children

    def sync(self) -> None:
        """Wait until everything appended so far has run; raise what failed."""
        with self._done:
            while self._ran < self._queued and self._error is None:
                self._done.wait()
            error = self._error
        if error is not None:
            raise error

    def finish(self) -> None:
        """The program returned: run what is queued (here and in every fork), then stop."""
        try:
            for state in [self, *self._all_forks()]:
                state.sync()
        finally:
            for state in [self, *self._all_forks()]:
                state._finished = True
                state._queue.put(None)

    def text_stream(self) -> Iterator[str]:
        """The text as it is appended (a gen's output as it is generated), until the
        program finishes (``run(stream=True)``)."""
        while (delta := self._deltas.get()) is not None:
            yield delta

    def _all_forks(self) -> list[ProgramState]:
        found: list[ProgramState] = []
        for child in self.forks:
            found += [child, *child._all_forks()]
        return found

    # ---- the state's thread ---------------------------------------------------------------
    def _run(self) -> None:
        while (expr := self._queue.get()) is not None:
            try:
                if self._error is None:
                    self._execute(expr)
            except BaseException as error:  # noqa: BLE001 - raised at the program's next sync point
                self._error = error
            with self._done:
                self._ran += 1
                self._done.notify_all()
        self._deltas.put(None)

    def _append(self, text: str) -> None:
        self._text += text
        self._deltas.put(text)

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, Text):
            self._append(expr.text)
        elif isinstance(expr, Concat):
            for part in expr.parts:
                self._execute(part)
        elif isinstance(expr, Role):
            before, after = self.backend.role_markers(expr.role)
            self._append(before)
            self._execute(expr.body)
            self._append(after)
        elif isinstance(expr, Gen):
            params = expr.sampling_params()
            started = time.perf_counter()
            first_text: list[float] = []

            def on_text(delta: str) -> None:
                if not first_text:
                    first_text.append(time.perf_counter() - started)
                self._deltas.put(delta)  # streamed as it comes

            try:
                result = self.backend.generate(self._text, params, on_text)
            except ValueError as error:  # the engine refused it: a constraint that cannot compile, ...
                raise LangError(f"gen {expr.name!r} was refused: {error}", expr.where) from None
            except (EngineFault, BackendClosed) as error:
                raise LangError(f"gen {expr.name!r} failed: {error}", expr.where) from error
            self.calls.append(Call(expr.name, result.num_prompt_tokens, result.num_cached_tokens,
                                   first_text[0] if first_text else None, time.perf_counter() - started))
            self._text += result.text
            if expr.name is not None:
                self._variables[expr.name] = result.text
        elif isinstance(expr, Select):
            try:
                scored = self.backend.score(self._text, list(expr.choices))
            except ValueError as error:  # nothing to score a choice after (an empty text), ...
                raise LangError(f"select {expr.name!r} was refused: {error}", expr.where) from None
            except (EngineFault, BackendClosed) as error:
                raise LangError(f"select {expr.name!r} failed: {error}", expr.where) from error
            best = max(range(len(expr.choices)), key=lambda i: scored.logprobs[i])  # the first of ties
            self.select_cached_tokens.append(scored.num_cached_tokens)
            self._append(expr.choices[best])
            if expr.name is not None:
                self._variables[expr.name] = expr.choices[best]
                self.select_scores[expr.name] = dict(zip(expr.choices, scored.logprobs, strict=True))
        else:
            raise LangError(f"cannot run {type(expr).__name__}")
