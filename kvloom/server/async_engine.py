"""AsyncEngine: the engine loop on its own thread, per-request streams on the event loop.

Threading contract:

* Only the engine thread touches the ``LLMEngine`` (it is not thread-safe). The event
  loop talks to it through one ``queue.SimpleQueue`` of commands (add, abort, call,
  stop), which the engine thread applies *between* steps.
* Results travel back with ``loop.call_soon_threadsafe``: one callback per step carries
  every output of that step to the per-group ``asyncio.Queue``\\ s.
* When there is nothing to run, the engine thread blocks in ``SimpleQueue.get()``: no
  busy loop, no sleep-polling; a new command wakes it.

Why a thread and not a process: the forward pass spends its time inside torch ops,
which release the GIL, so the event loop keeps serving HTTP while the model runs, and
a thread shares the tokenizer and needs no serialisation of outputs. A brief
measurement (docs/api.md, "Threading") found the engine on this thread as fast as the
bare engine loop within noise, and /health answering in a few milliseconds mid-
generation. What a process split would win back is the per-token JSON/SSE work on
the event loop competing for the GIL, at the price of pickling every step's outputs.

Invariant: the engine is built on the engine thread, and the event loop never runs an
OpenMP region (a large torch op). One more OpenMP team in the process than the engine's
makes libgomp manage more threads than there are CPUs, and it then cuts every barrier's
spin to a few iterations: each of a step's ~300 parallel regions sleeps and wakes on a
futex. On two cores that cost a decode step 12-28% (docs/results/issue17/genoa6/
forward_thread.txt); the server as it stands runs one team (checked with gdb).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvloom.engine.admission import RequestRejected
from kvloom.engine.engine import LLMEngine
from kvloom.engine.output import RequestOutput, StepProgress
from kvloom.model_families import ClassifierConfig
from kvloom.models.errors import ModelLoadError
from kvloom.server.metrics import EngineMetrics
from kvloom.server.stats_log import StatsLogger
from kvloom.server.streams import (
    EngineFailed,
    EngineNotReady,
    EngineOverloaded,
    EngineRequest,
    EngineSnapshot,
    ModelInfo,
    RequestAborted,
    ResultStream,
)

__all__ = ["AsyncEngine", "EngineFailed", "EngineNotReady", "EngineOverloaded", "EngineRequest", "EngineSnapshot",
           "ModelInfo", "RequestAborted", "ResultStream"]

logger = logging.getLogger(__name__)


# ---- commands (event loop -> engine thread) ----------------------------------------------
@dataclass(slots=True)
class _Add:
    requests: list[EngineRequest]
    stream: ResultStream
    accepted: asyncio.Future[None]


@dataclass(slots=True)
class _Abort:
    stream: ResultStream


@dataclass(slots=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    result: asyncio.Future[Any]


class _Stop:
    pass


class StepObserver(Protocol):
    """Sees the engine after each loop iteration, on the engine thread: the step's
    outputs and its progress (``LLMEngine.progress()``; both empty when nothing ran),
    ``engine.stats()``, ``time.monotonic()``. A non-streaming request has no output
    before it finishes, but progress every step it moves. An observer may read the
    engine (its scheduler's trace, requests) but never change it, and must be quick: it
    runs between two steps."""

    def on_step(self, engine: LLMEngine, outputs: Sequence[RequestOutput], progress: Sequence[StepProgress],
                stats: Any, now: float) -> None: ...


class AsyncEngine:
    """Runs an ``LLMEngine`` built by ``engine_factory`` on a dedicated thread.

    ``start()`` must be called from the event loop that will consume results; the model
    loads on the engine thread, so the server answers ``/health`` (503) meanwhile.
    """

    def __init__(self, engine_factory: Callable[[], LLMEngine], max_waiting: int = 1024,
                 metrics: EngineMetrics | None = None,
                 stats_log_interval: float | None = None,
                 observers: Sequence[StepObserver] = ()) -> None:
        """``stats_log_interval``: seconds between the stats lines logged while busy
        (server/stats_log.py); None logs none. ``observers`` see every loop iteration
        on the engine thread (the dashboard's live stats, OpenTelemetry traces)."""
        self.max_waiting = max_waiting
        self.observers = list(observers)
        self._stats_log = (StatsLogger(stats_log_interval, time.monotonic())
                           if stats_log_interval is not None else None)
        self.metrics = metrics if metrics is not None else EngineMetrics()
        self.info: ModelInfo | None = None
        self.load_error: BaseException | None = None
        self.engine_error: BaseException | None = None
        self._factory = engine_factory
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call | _Stop] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.on_load_failed: Callable[[BaseException], None] | None = None
        # What the server asks of the loaded model before serving it (a reasoning parser's
        # markers in its vocabulary): each raises ValueError naming what is missing, which
        # fails the load.
        self.load_checks: list[Callable[[LLMEngine], None]] = []
        # Called on the engine thread after an engine fault has failed every request.
        self.on_engine_failed: Callable[[BaseException], None] | None = None
        # Admission accounting, shared by both threads under the lock: requests sent
        # but not yet applied, plus the engine's waiting queue after its last update.
        self._lock = threading.Lock()
        self._num_pending = 0
        self._num_waiting = 0
        # Engine thread only: request id -> (its stream, its index in the group).
        self._active: dict[str, tuple[ResultStream, int]] = {}

    # ---- lifecycle (event loop) ------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (once); results go to the running event loop."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvloom-engine", daemon=True)
        self._thread.start()

    def request_shutdown(self) -> None:
        """Abort everything in flight and stop the engine thread. Safe to call from a
        signal handler (SimpleQueue.put is reentrant) and more than once."""
        if not self._stopping:
            self._stopping = True
            self._commands.put(_Stop())

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Request shutdown and wait for the engine thread to exit."""
        self.request_shutdown()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    # ---- requests (event loop) -------------------------------------------------------
    async def generate(self, requests: list[EngineRequest]) -> ResultStream:
        """Queue a group of requests; returns once the engine accepted all of them.

        Raises ``EngineNotReady``, ``EngineOverloaded``, or a ``ValueError`` for a request
        that can never be served: the engine's verdict, or a group larger than
        ``max_waiting`` (then none of the group runs)."""
        self.check_ready()
        if len(requests) > self.max_waiting > 0:  # no retry can help: refuse it as bad input
            raise RequestRejected(
                f"the request asks for {len(requests)} sequences (prompts x n), more than this "
                f"server ever queues at once (--max-waiting {self.max_waiting}); send fewer "
                "prompts or a smaller n", None, "too_many_sequences")
        with self._lock:
            if self._num_waiting + self._num_pending + len(requests) > self.max_waiting:
                raise EngineOverloaded(
                    f"the server is overloaded: {self._num_waiting + self._num_pending} requests "
                    f"are waiting (limit {self.max_waiting}); retry later")
            self._num_pending += len(requests)
        stream = ResultStream([r.request_id for r in requests], self._abort_stream)
        accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._submit(_Add(requests, stream, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps; return its result."""
        self.check_ready()
        result: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._submit(_Call(fn, result))
        return await result

    async def snapshot(self) -> EngineSnapshot:
        """Check the engine's block accounting and report it (for tests and debugging)."""
        active = self._active

        def probe(engine: LLMEngine) -> EngineSnapshot:
            engine.check_integrity()
            kv = engine.kv_manager
            stats = engine.stats()
            return EngineSnapshot(engine.num_blocks, kv.pool.num_free_blocks,
                                  kv.num_available_blocks, stats.num_running,
                                  stats.num_waiting, len(active))
        return await self.call(probe)

    def snapshot_from_thread(self, timeout: float = 10.0) -> EngineSnapshot:
        """``snapshot()`` for a caller on another thread than the event loop's (tests)."""
        if self._loop is None:
            raise EngineNotReady("the engine has not been started")
        return asyncio.run_coroutine_threadsafe(self.snapshot(), self._loop).result(timeout)

    def check_ready(self) -> None:
        """Raise ``EngineNotReady`` unless requests can be accepted now."""
        if self._stopping:
            raise EngineNotReady("the server is shutting down")
        if self.engine_error is not None:
            raise EngineNotReady("the engine failed; see the server log")
        if self.load_error is not None:
            raise EngineNotReady(f"the model failed to load: {self.load_error}")
        if self.info is None:
            raise EngineNotReady("the model is still loading")

    def _submit(self, command: _Add | _Abort | _Call) -> None:
        self._commands.put(command)

    def _abort_stream(self, stream: ResultStream) -> None:
        self._submit(_Abort(stream))

    # ---- engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._factory()
            for check in self.load_checks:
                try:
                    check(engine)
                except ValueError as error:  # the user's flags, not the model's fault: one line
                    raise ModelLoadError(str(error)) from None
        except BaseException as error:  # noqa: BLE001 - any load failure is reported, not raised
            if isinstance(error, ModelLoadError):  # a one-line, user-facing message
                logger.error("model failed to load: %s", error)
            else:
                logger.exception("model failed to load")
            self.load_error = error
            if self.on_load_failed is not None:
                self.on_load_failed(error)
            return
        self.info = ModelInfo(engine.model_name, engine.limits, engine.tokenizer,
                              dict(getattr(engine, "generation_defaults", {})),
                              engine.kv_transfer.info() if hasattr(engine, "kv_transfer") else {"role": "both"},
                              tuple(getattr(engine, "eos_token_ids", ())), *_pooling_facts(engine))
        logger.info("engine ready: %s (context %d, %d KV blocks)", engine.model_name,
                    engine.max_model_len, engine.num_blocks)
        try:
            self._loop_until_stopped(engine)
        except BaseException as error:  # noqa: BLE001 - an engine bug must not hang clients
            # Failures of one request are isolated inside LLMEngine.step (that request
            # alone ends with an error); what reaches here is the engine's own fault.
            logger.exception("engine fault: failing every in-flight request; the server will exit")
            self.engine_error = error
            self._fail_all(EngineFailed(f"the engine failed while running this request "
                                        f"({type(error).__name__}); the server is restarting"))
            if self.on_engine_failed is not None:
                self.on_engine_failed(error)
        finally:
            self._drain_after_stop()
            shutdown = getattr(engine, "shutdown", None)  # test doubles may have none
            if shutdown is not None:
                shutdown()  # a tensor-parallel engine's other ranks stop with it

    def _loop_until_stopped(self, engine: LLMEngine) -> None:
        while True:
            # Block only when idle: with work pending, pick up commands and go on stepping.
            idle = not engine.has_unfinished_requests()
            commands = self._take_commands(block=idle)
            if idle and self._stats_log is not None:
                self._stats_log.resume(time.monotonic())
            for command in commands:
                if not isinstance(command, _Stop):
                    self._apply(engine, command)
            if any(isinstance(command, _Stop) for command in commands):
                # Requests added alongside the stop are aborted with the rest.
                self._abort_all(engine, RequestAborted("the server is shutting down"))
                return
            outputs = engine.step() if engine.has_unfinished_requests() else None
            progress = engine.progress() if outputs is not None else []
            now = time.monotonic()
            stats = engine.stats()
            with self._lock:
                self._num_waiting = stats.num_waiting
            self.metrics.record_state(stats)
            if self._stats_log is not None:
                line = self._stats_log.observe(now, stats)
                if line is not None:
                    logger.info("%s", line)
            if outputs is not None:
                # Until the engine reports the step's scheduled tokens, the histogram
                # stays empty rather than showing a guess.
                self.metrics.record_step(progress, now, getattr(stats, "num_batched_tokens", None))
                # Delivered after the state is published: a client that has seen a
                # token also sees the admission counts of the step that produced it.
                self._deliver_from_thread(outputs)
            self._notify(engine, outputs or [], progress, stats, now)

    def _notify(self, engine: LLMEngine, outputs: Sequence[RequestOutput], progress: Sequence[StepProgress],
                stats: Any, now: float) -> None:
        """The observers' turn; one that fails is logged and dropped, never an engine fault."""
        for observer in list(self.observers):
            try:
                observer.on_step(engine, outputs, progress, stats, now)
            except Exception:  # noqa: BLE001 - observing must not stop serving
                logger.exception("step observer %s failed; it is removed", type(observer).__name__)
                self.observers.remove(observer)

    def _take_commands(self, block: bool) -> list[_Add | _Abort | _Call | _Stop]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, engine: LLMEngine, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Add):
            self._add(engine, command)
        elif isinstance(command, _Abort):
            for request_id in command.stream.request_ids:
                if self._active.pop(request_id, None) is not None:
                    engine.abort_request(request_id)
                    self.metrics.record_aborted(request_id)
        else:
            try:
                value = command.fn(engine)
            except Exception as error:  # noqa: BLE001 - delivered to the caller
                self._resolve(command.result, error=error)
            else:
                self._resolve(command.result, value=value)

    def _add(self, engine: LLMEngine, command: _Add) -> None:
        added: list[str] = []
        try:
            for index, request in enumerate(command.requests):
                engine.add_request(request.prompt_token_ids, request.params,
                                   request_id=request.request_id, priority=request.priority,
                                   arrival_time=request.arrival_time, kv_transfer=request.kv_transfer,
                                   cache_salt=request.cache_salt, lora_request=request.lora_request)
                added.append(request.request_id)
                self._active[request.request_id] = (command.stream, index)
        except Exception as error:  # noqa: BLE001 - ValueError: unservable; delivered as such
            for request_id in added:  # all or nothing: the group is one HTTP request
                self._active.pop(request_id, None)
                engine.abort_request(request_id)
            self._resolve(command.accepted, error=error)
        else:
            self._resolve(command.accepted, value=None)
        finally:
            num_waiting = engine.stats().num_waiting
            with self._lock:
                self._num_pending -= len(command.requests)
                self._num_waiting = num_waiting

    def _deliver_from_thread(self, outputs: list[RequestOutput]) -> None:
        """Route a step's outputs to their streams with one event-loop callback."""
        batch: list[tuple[ResultStream, int, RequestOutput]] = []
        for output in outputs:
            owner = self._active.get(output.request_id)
            if owner is None:  # aborted meanwhile: nobody listens
                continue
            if output.finished:
                del self._active[output.request_id]
            batch.append((owner[0], owner[1], output))
        if batch:
            self._call_soon(_deliver, batch)

    def _abort_all(self, engine: LLMEngine, reason: BaseException) -> None:
        for request_id in list(self._active):
            engine.abort_request(request_id)
        self._fail_all(reason)

    def _fail_all(self, reason: BaseException) -> None:
        streams = {id(stream): stream for stream, _ in self._active.values()}
        self._active.clear()
        for stream in streams.values():
            self._call_soon(stream.put, reason)

    def _drain_after_stop(self) -> None:
        """Answer commands that arrived after the loop ended, so no caller waits forever."""
        for command in self._take_commands(block=False):
            if isinstance(command, _Add):
                self._resolve(command.accepted, error=EngineNotReady("the server is shutting down"))
            elif isinstance(command, _Call):
                self._resolve(command.result, error=EngineNotReady("the server is shutting down"))

    def _resolve(self, future: asyncio.Future[Any], value: Any = None,
                 error: BaseException | None = None) -> None:
        self._call_soon(_set_future, future, value, error)

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass


def _deliver(batch: list[tuple[ResultStream, int, RequestOutput]]) -> None:
    for stream, index, output in batch:
        stream.put((index, output))


def _set_future(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():  # the caller went away (cancelled) meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _pooling_facts(engine: LLMEngine) -> tuple[int, tuple[int, ...] | None, ClassifierConfig | None, str | None]:
    """ModelInfo's (hidden_size, matryoshka_dimensions, classifier, score_template) of the
    loaded model (a stand-in engine in tests may have no model_config: no pooling facts
    then). The score template is the one given explicitly (``--chat-template``), as vLLM
    applies one: a model's own chat template is often its base model's, no score template."""
    config = getattr(engine, "model_config", None)
    if config is None:
        return 0, None, None, None
    sizes = (config.matryoshka_dimensions or ()) if config.is_matryoshka else None
    explicit = engine.config.chat_template is not None
    return config.hidden_size, sizes, config.classifier, engine.tokenizer.chat_template if explicit else None
