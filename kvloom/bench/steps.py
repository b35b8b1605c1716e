"""`kvloom bench steps`: the time of one engine step, by shape.

Decode: ``batch`` sequences of ``context`` prompt tokens are prefilled, then
``decode_steps`` pure decode steps are timed one by one (each a whole
``LLMEngine.step()``: scheduling, the forward, sampling, output processing). Prefill:
steps that each prefill ``count`` fresh prompts of ``length`` tokens at once (the
prefix cache is off, so nothing is reused). Prompts are random token ids, so every
engine option sees the same work; greedy, ``ignore_eos``.

Prints min / median / max per shape (the machine is noisy: compare medians of runs
taken the same hour) and returns the records for JSON. Under tensor parallel each
step's collectives are counted too: calls, bytes rank 0 handed to them, and the time
rank 0 spent inside them (which includes waiting for the slowest rank).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import SamplingParams


@dataclass(frozen=True)
class StepTiming:
    shape: str  # "decode b16 x 300" or "prefill 8 x 256"
    milliseconds: list[float]
    # Per timed step, tensor parallel only (else empty): collectives, their bytes, their ms.
    comm_calls: list[int] = field(default_factory=list)
    comm_bytes: list[int] = field(default_factory=list)
    comm_milliseconds: list[float] = field(default_factory=list)
    # Decode only: per timed step, the mean number of keys its sequences' attention read
    # (their cached tokens after the step, the new one included).
    kv_tokens: list[float] = field(default_factory=list)

    @property
    def summary(self) -> str:
        ms = sorted(self.milliseconds)
        line = (f"{self.shape:<22} min {ms[0]:8.1f}  median {statistics.median(ms):8.1f}  "
                f"max {ms[-1]:8.1f} ms  ({len(ms)} steps)")
        if self.comm_calls:
            line += (f"  collectives {statistics.median(self.comm_calls):.0f}/step, "
                     f"{statistics.median(self.comm_bytes) / 1024:.1f} KiB, "
                     f"{statistics.median(self.comm_milliseconds):.2f} ms")
        return line


class _StepClock:
    """Times whole engine steps, and the tensor-parallel collectives inside them."""

    def __init__(self, engine: LLMEngine) -> None:
        self.stats = engine.first_rank.group.stats
        self.tensor_parallel = engine.first_rank.group.size > 1
        self.milliseconds: list[float] = []
        self.calls: list[int] = []
        self.bytes: list[int] = []
        self.comm_milliseconds: list[float] = []

    def step(self, engine: LLMEngine) -> list[Any]:
        calls, sent, seconds = self.stats.calls, self.stats.bytes, self.stats.seconds
        start = time.perf_counter()
        outputs = engine.step()
        self.milliseconds.append((time.perf_counter() - start) * 1e3)
        if self.tensor_parallel:
            self.calls.append(self.stats.calls - calls)
            self.bytes.append(self.stats.bytes - sent)
            self.comm_milliseconds.append((self.stats.seconds - seconds) * 1e3)
        return outputs

    def timing(self, shape: str, skip: int = 0, kv_tokens: list[float] | None = None) -> StepTiming:
        return StepTiming(shape, self.milliseconds[skip:], self.calls[skip:], self.bytes[skip:],
                          self.comm_milliseconds[skip:], kv_tokens or [])


def _prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(10, vocab_size) for _ in range(length)]


def _drain(engine: LLMEngine, request_ids: list[str]) -> None:
    for request_id in request_ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def centred_prompt(context: int, steps: int, batch: int = 1, step_tokens: int = 2048) -> int:
    """The prompt length whose timed decode steps read ``context`` keys on average.
    Decode step j of a prompt of P tokens reads P + j keys (the prompt, the tokens
    sampled before, and its own), so steps 1 .. ``steps`` read P + (steps + 1) / 2 on
    average; and where ``batch`` prompts take several prefill steps of ``step_tokens``,
    the sequences prefilled first decode during the later ones, about half of those
    steps ahead on average."""
    prompt = context - (steps + 1) // 2
    prefill_steps = -(-batch * max(prompt, 1) // step_tokens)
    prompt -= prefill_steps // 2
    if prompt < 1:
        raise ValueError(f"{steps} decode steps of {batch} sequences cannot centre on a context of {context} tokens")
    return prompt


def time_decode(engine: LLMEngine, batch: int, context: int, steps: int, seed: int,
                centred: bool = False) -> StepTiming:
    """``steps`` pure decode steps of ``batch`` sequences whose prompts are ``context``
    tokens, or (``centred``) whose timed steps read ``context`` keys on average, as a
    decode-step bound at that context assumes (the sequences that start decoding while
    others still prefill read a few more)."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    budget = engine.config.scheduler.max_num_batched_tokens
    prompt_len = centred_prompt(context, steps, batch, budget) if centred else context
    # Long enough that the first sequences, which decode while the last ones still
    # prefill, are all still running during the timed steps.
    prefill_steps = -(-batch * prompt_len // budget)
    params = SamplingParams(max_tokens=steps + prefill_steps + 8, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(_prompt(rng, prompt_len, vocab), params) for _ in range(batch)]
    started: set[str] = set()
    while len(started) < batch:  # prefill everything first: the timed steps are pure decodes
        started.update(output.request_id for output in engine.step() if output.outputs[0].token_ids)
    clock = _StepClock(engine)
    kv_tokens = []
    for _ in range(steps):
        outputs = clock.step(engine)
        assert len(outputs) == batch and not any(output.finished for output in outputs), "not a pure decode"
        kv_tokens.append(statistics.fmean(request.num_computed_tokens for request in requests))
    _drain(engine, [request.request_id for request in requests])
    return clock.timing(f"decode b{batch} x {context}", kv_tokens=kv_tokens)


def time_prefill(engine: LLMEngine, count: int, length: int, repeats: int, seed: int) -> StepTiming:
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    clock = _StepClock(engine)
    for _ in range(repeats + 1):  # the first is a warm-up
        ids = [engine.add_request(_prompt(rng, length, vocab), params).request_id for _ in range(count)]
        clock.step(engine)
        _drain(engine, ids)
    return clock.timing(f"prefill {count} x {length}", skip=1)


def run_steps(model: str, engine_kwargs: dict[str, Any], batches: list[int], context: int,
              decode_steps: int, prefills: list[tuple[int, int]], repeats: int) -> list[StepTiming]:
    largest_prefill = max((count * length for count, length in prefills), default=0)
    tokens_needed = max(batches, default=0) * (context + decode_steps + 16) + largest_prefill
    kwargs: dict[str, Any] = dict(enable_prefix_caching=False, max_num_seqs=max(batches + [256]),
                                  max_num_batched_tokens=max(2048, largest_prefill),
                                  num_blocks=tokens_needed // 16 + 64)
    kwargs.update(engine_kwargs)
    engine = LLMEngine(EngineConfig.from_kwargs(model, **kwargs))
    results = []
    time_decode(engine, batches[0] if batches else 1, context, 3, seed=99)  # warm-up
    for count, length in prefills:
        results.append(time_prefill(engine, count, length, repeats, seed=count * length))
        print(results[-1].summary, flush=True)
    for batch in batches:
        results.append(time_decode(engine, batch, context, decode_steps, seed=batch))
        print(results[-1].summary, flush=True)
    engine.shutdown()
    return results


def as_json(results: list[StepTiming]) -> list[dict[str, Any]]:
    return [asdict(result) | {"median_ms": statistics.median(result.milliseconds)} for result in results]


def time_prefix_hit(engine: LLMEngine, shared: int, suffix: int, repeats: int, seed: int) -> StepTiming:
    """The step that computes ``suffix`` fresh tokens after a prefix-cache hit of
    ``shared`` tokens (a multiple of the block size), once per repeat on a new prefix:
    two requests with the prefix and different suffixes run first (for a state-space
    model the second leaves the cached tree after the prefix and saves the state
    there), then a third is timed. Needs an engine with prefix caching; raises if the
    third did not hit the whole prefix."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    clock = _StepClock(engine)
    for _ in range(repeats):
        prefix = _prompt(rng, shared, vocab)
        for _warm in range(2):  # each to its end, so that its blocks (and state) are cached
            engine.add_request(prefix + _prompt(rng, suffix, vocab), params)
            while engine.has_unfinished_requests():
                engine.step()
        request = engine.add_request(prefix + _prompt(rng, suffix, vocab), params)
        clock.step(engine)
        if request.num_cached_tokens != shared:
            raise RuntimeError(f"the timed request hit {request.num_cached_tokens} of {shared} prefix tokens "
                               f"({request.cache_miss_reason})")
        _drain(engine, [request.request_id])
    return clock.timing(f"prefill 1 x {suffix} after a {shared}-token hit")

