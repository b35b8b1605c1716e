"""`kvloom bench placement`: the engine loop in a thread vs in a separate process.

The server keeps the model off the HTTP event loop. This measures the two ways of
doing that on the same workload: the engine stepping in a thread of the consumer's
process (deltas cross through an in-process queue), or in a child process (deltas
cross through a multiprocessing queue, pickled). The consumer reads every delta as a
streaming client would. The result decides the server's design (docs/api.md).
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
from typing import Any

from kvloom.sampling_params import SamplingParams

_DONE = None


class _Failed(str):
    """The engine loop's error, sent in place of ``_DONE`` so that the consumer ends
    (it would wait on the queue forever)."""


def _engine_loop(model: str, engine_kwargs: dict[str, Any], prompts: list[list[int]],
                 max_tokens: int, out: Any) -> None:
    try:
        _run_engine(model, engine_kwargs, prompts, max_tokens, out)
    except BaseException as error:  # noqa: BLE001 - reported to the consumer, which raises it
        out.put(_Failed(f"{type(error).__name__}: {error}"))


def _run_engine(model: str, engine_kwargs: dict[str, Any], prompts: list[list[int]],
                max_tokens: int, out: Any) -> None:
    from kvloom.config import EngineConfig
    from kvloom.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_kwargs))
    engine.add_request([1] * 32, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    out.put("ready")
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        # One message per step, as the server's engine thread sends them.
        out.put([(o.request_id, o.outputs[0].delta_token_ids, o.finished) for o in engine.step()])
    out.put(_DONE)


def _consume(out: Any) -> tuple[float, int]:
    _check(out.get())
    start, tokens = time.perf_counter(), 0
    while (batch := _check(out.get())) is not _DONE:
        tokens += sum(len(delta) for _, delta, _ in batch)
    return time.perf_counter() - start, tokens


def _check(message: Any) -> Any:
    if isinstance(message, _Failed):
        raise RuntimeError(f"the engine loop failed: {message}")
    return message


def measure(model: str, engine_kwargs: dict[str, Any], num_requests: int, prompt_len: int,
            max_tokens: int) -> dict[str, float]:
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(num_requests)]
    args = (model, engine_kwargs, prompts, max_tokens)
    spawn = multiprocessing.get_context("spawn")
    # (label, a queue the consumer reads, how to run the engine loop beside it)
    placements = [("thread", queue.Queue(), threading.Thread),
                  ("process", spawn.Queue(), spawn.Process)]
    results: dict[str, float] = {}
    for label, channel, runner in placements:
        worker = runner(target=_engine_loop, args=(*args, channel))
        worker.start()
        seconds, tokens = _consume(channel)
        worker.join()
        results[label] = tokens / seconds
    return results
