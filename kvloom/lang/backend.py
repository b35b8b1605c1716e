"""Where a program's text goes: the ``Backend`` seam, and ``Local``, an in-process
``LLM`` driven by one thread for every program at once.

A backend answers two questions about a text: its continuation under some sampling
parameters (``generate``), and the log-probability of each of several continuations
(``score``). Both are blocking and thread-safe: each program state runs on its own
thread (state.py), so many programs, and the forks of one, are in the engine's batch
together; the radix cache shares what their texts share.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from kvloom.engine.llm import LLM
from kvloom.engine.output import RequestOutput
from kvloom.engine.scoring import continuations
from kvloom.lang.errors import BackendClosed, EngineFault
from kvloom.sampling_params import SamplingParams


@dataclass(frozen=True)
class Generated:
    text: str
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens the prefix cache served


@dataclass(frozen=True)
class Scored:
    logprobs: list[float]  # per choice: the sum over its tokens
    num_cached_tokens: list[int]


class Backend(Protocol):
    def role_markers(self, role: str) -> tuple[str, str]:
        """The chat template's text before and after a ``role`` message's content."""
        ...

    def generate(self, text: str, params: SamplingParams,
                 on_text: Callable[[str], None] | None = None) -> Generated:
        """``on_text``: called with each new piece of the output as it is generated."""
        ...

    def score(self, text: str, choices: list[str]) -> Scored: ...


class Local:
    """An in-process engine (``kl.Local(LLM(...))``). Its engine is driven by this
    backend's thread from now on: do not call the ``LLM`` from elsewhere meanwhile.
    The calling thread hands the engine over (``LLMEngine.hand_over``: its OpenMP team
    is released, so the driver's is the process's only one)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        llm.engine.hand_over()
        self.tokenizer = llm.tokenizer
        self._markers: dict[str, tuple[str, str]] = {}
        self._pending: list[tuple[list[int], SamplingParams, Future[RequestOutput], OnText]] = []
        self._futures: dict[str, tuple[Future[RequestOutput], OnText]] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._drive, name="kvloom-lang-local", daemon=True)
        self._thread.start()

    def role_markers(self, role: str) -> tuple[str, str]:
        if role not in self._markers:
            self._markers[role] = self.tokenizer.role_markers(role)
        return self._markers[role]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def generate(self, text: str, params: SamplingParams,
                 on_text: Callable[[str], None] | None = None) -> Generated:
        token_ids = self.encode(text)
        output = self._submit(token_ids, params, on_text).result()
        return Generated(output.outputs[0].text, len(token_ids), output.num_cached_tokens)

    def score(self, text: str, choices: list[str]) -> Scored:
        """Each choice's tokens' log-probabilities after ``text``, summed; all choices
        submitted at once (the first computes the shared prefix, the rest wait a step
        for it and hit, engine/scheduler.py), from the first token where ``text +
        choice`` tokenizes differently from ``text``."""
        wanted = continuations(self.encode(text), [self.encode(text + choice) for choice in choices])
        futures = [self._submit(c.token_ids, c.params) for c in wanted]
        outputs = [future.result() for future in futures]
        return Scored([c.logprob(o) for c, o in zip(wanted, outputs, strict=True)],
                      [o.num_cached_tokens for o in outputs])

    def close(self) -> None:
        """Stop the driver thread; calls still waiting fail with BackendClosed, later ones too."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=10.0)

    # ---- the driver thread --------------------------------------------------------------
    def _submit(self, token_ids: list[int], params: SamplingParams,
                on_text: OnText = None) -> Future[RequestOutput]:
        future: Future[RequestOutput] = Future()
        with self._wake:
            if self._stopping:
                raise BackendClosed("this kl.Local backend is closed: make a new one to run programs")
            self._pending.append((token_ids, params, future, on_text))
            self._wake.notify()
        return future

    def _drive(self) -> None:
        engine = self.llm.engine
        while True:
            with self._wake:
                while not self._pending and not engine.has_unfinished_requests() and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    self._fail_all(engine, [future for _, _, future, _ in self._pending],
                                   BackendClosed("this kl.Local backend was closed before the call ended"))
                    return
                pending, self._pending = self._pending, []
            for token_ids, params, future, on_text in pending:
                try:
                    request = engine.add_request(token_ids, params)
                except Exception as error:  # noqa: BLE001 - that request's own (a bad constraint)
                    future.set_exception(error)
                else:
                    self._futures[request.request_id] = (future, on_text)
            try:
                outputs = engine.step()
            except Exception as error:  # noqa: BLE001 - an engine fault fails everyone waiting
                fault = EngineFault(f"the engine failed in a step ({type(error).__name__}: {error})")
                fault.__cause__ = error
                self._fail_all(engine, [], fault)
                continue
            for output in outputs:
                future, on_text = self._futures[output.request_id]
                delta = output.outputs[0].delta_text
                if on_text is not None and delta:
                    on_text(delta)  # the state's queue: cheap, never blocks
                if output.finished:
                    del self._futures[output.request_id]
                    if output.error is not None:
                        future.set_exception(RuntimeError(output.error.message))
                    else:
                        future.set_result(output)

    def _fail_all(self, engine: Any, waiting: list[Future[RequestOutput]], error: Exception) -> None:
        """Abort every request this backend has in the engine (none is left to be stepped
        again) and fail their calls and the ``waiting`` ones with ``error``."""
        for request_id, (future, _) in self._futures.items():
            engine.abort_request(request_id)
            waiting.append(future)
        self._futures.clear()
        for future in waiting:
            future.set_exception(error)


OnText = Callable[[str], None] | None
