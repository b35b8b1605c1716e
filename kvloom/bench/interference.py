"""`kvloom bench interference`: what long prompts arriving do to requests that decode.

Against an OpenAI-compatible server (``kvloom serve``, or a router in front of prefill
and decode instances), on streamed /v1/completions of random token ids (greedy,
``ignore_eos``; the first ids of all prompts are distinct, so no two share a cached
block): ``decodes`` requests start, long enough to outlast the run; once every one
streams (its second token has come: it is past its prefill, in the running batch) and
``baseline_s`` more seconds have passed, ``num_prompts`` long prompts arrive as a seeded
Poisson process. When they have all ended, the decodes are closed (the server aborts
them).

``bench serve``'s ``send_request`` streams and parses each request, so the definitions
are those of ``kvloom.bench.metrics``; a stream's token times are rebuilt from its
record (send time + TTFT + the gaps). From them:

- the long prompts' TTFT and E2E;
- the decodes' ITL in the window from the first long prompt's send to the last one's end
  (a gap counts where its later token arrived inside), and in the baseline before it;
- output token throughput in the window: every token that arrived inside it. A long
  prompt counts its usage; a decode, closed before any usage, one token per text event
  (kvloom sends one per step unless the detokenizer holds back part of a character,
  and then the next event carries both);
- the deltas, over the long prompts, of the server's counters named "*transfer*" (the
  KV moved between instances), in total and per long prompt.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

import httpx

from kvloom.bench.arrivals import arrival_offsets, inter_arrival_gaps, paced
from kvloom.bench.metrics import Distribution, RequestRecord
from kvloom.bench.serve import COMPLETIONS, http_client, resolve_model, scrape_metrics, send_request

__all__ = ["InterferenceConfig", "Stream", "analyse", "format_report", "random_prompts", "run_interference"]

FIRST_ID = 100  # lower ids are left out: special tokens live there in most vocabularies


@dataclass(frozen=True)
class InterferenceConfig:
    base_url: str
    model: str | None = None  # None: the first id of GET /v1/models
    decodes: int = 32
    decode_prompt_len: int = 64
    decode_output_len: int = 1024
    num_prompts: int = 16
    prompt_len: int = 1500
    prompt_output_len: int = 16
    request_rate: float = 1.0
    seed: int = 0
    vocab_size: int = 49152
    baseline_s: float = 2.0  # decodes alone before the first long prompt
    request_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("decode_prompt_len", "num_prompts", "prompt_len", "prompt_output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.decodes < 0:
            raise ValueError(f"decodes must be >= 0, got {self.decodes}")
        if self.decode_output_len < 2:
            raise ValueError(f"decode_output_len must be >= 2 (a decode must stream), got {self.decode_output_len}")
        if self.vocab_size - FIRST_ID < self.decodes + self.num_prompts:
            raise ValueError(f"vocab_size {self.vocab_size} has too few ids for distinct prompts")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if not self.baseline_s >= 0:
            raise ValueError(f"baseline_s must be >= 0, got {self.baseline_s}")


def random_prompts(lengths: Sequence[int], vocab_size: int, rng: random.Random) -> list[list[int]]:
    """Token-id prompts of ``lengths``, ids in [FIRST_ID, vocab_size), each starting with
    a different id (so no prefix-cache hit between any two)."""
    firsts = rng.sample(range(FIRST_ID, vocab_size), len(lengths))
    return [[first] + [rng.randrange(FIRST_ID, vocab_size) for _ in range(length - 1)]
            for first, length in zip(firsts, lengths, strict=True)]


def _payload(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


class _GapLog(list[float]):
    """A record's ``itl`` that calls ``on_first`` when ``send_request`` appends the first
    gap (the stream's second token): the run waits on that, not by polling. (Built like a
    list, too: ``dataclasses.asdict`` copies it that way.)"""

    def __init__(self, gaps: Iterable[float] = (), on_first: Callable[[], None] | None = None) -> None:
        super().__init__(gaps)
        self._on_first = on_first

    def append(self, gap: float, /) -> None:
        super().append(gap)
        if len(self) == 1 and self._on_first is not None:
            self._on_first()


@dataclass(slots=True, eq=False)
class Stream:
    """One request of the run: ``decode`` or ``prompt`` (a long one); times in seconds
    after the run started."""

    kind: str
    record: RequestRecord
    sent_at: float = 0.0
    ended_by_server: bool = False  # a decode that ended (finished or failed) before it was closed

    def token_times(self) -> list[float]:
        if self.record.ttft is None:
            return []
        times = [self.sent_at + self.record.ttft]
        for gap in self.record.itl:
            times.append(times[-1] + gap)
        return times

    @property
    def end(self) -> float:
        return self.sent_at + (self.record.e2e or 0.0)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "sent_at": self.sent_at, "ended_by_server": self.ended_by_server,
                **self.record.to_json()}


def _gaps(streams: Sequence[Stream], after: float, until: float, whole: bool = False) -> list[float]:
    """The gaps between consecutive tokens whose later token came in (after, until]
    (``whole``: and the earlier one at or after ``after``)."""
    gaps = []
    for stream in streams:
        times = stream.token_times()
        gaps += [later - earlier for earlier, later in itertools.pairwise(times)
                 if after < later <= until and (not whole or earlier >= after)]
    return gaps


def _itl(gaps: Sequence[float]) -> dict[str, float]:
    return {**asdict(Distribution.of_seconds(gaps)), "max": 1e3 * max(gaps, default=0.0)}


def analyse(decodes: Sequence[Stream], prompts: Sequence[Stream], streaming_at: float) -> dict[str, Any]:
    """The report's numbers from the recorded streams; ``streaming_at``: when every
    decode streamed (the baseline runs from then to the first long prompt)."""
    if not prompts:
        raise ValueError("no long prompts to analyse")
    start = min(p.sent_at for p in prompts)
    end = max(p.end for p in prompts)
    ok = [p for p in prompts if p.record.success]
    decode_tokens = sum(start < t <= end for stream in decodes for t in stream.token_times())
    prompt_tokens = sum(p.record.output_len if p.record.success else len(p.token_times()) for p in prompts)
    window = end - start
    errors = Counter(s.record.error for s in (*decodes, *prompts) if s.record.error is not None)
    return {
        "window_s": window, "baseline_s": max(0.0, start - streaming_at),
        "counts": {"decodes": len(decodes), "decodes_streaming": sum(len(d.record.itl) > 0 for d in decodes),
                   "decodes_failed": sum(not d.record.success for d in decodes),
                   "decodes_ended_early": sum(d.ended_by_server for d in decodes),
                   "prompts": len(prompts), "prompts_completed": len(ok), "prompts_failed": len(prompts) - len(ok)},
        "prompt_ttft_ms": asdict(Distribution.of_seconds([p.record.ttft for p in ok if p.record.ttft is not None])),
        "prompt_e2e_ms": asdict(Distribution.of_seconds([p.record.e2e for p in ok if p.record.e2e is not None])),
        "decode_itl_ms": _itl(_gaps(decodes, start, end)),
        "decode_itl_baseline_ms": _itl(_gaps(decodes, streaming_at, start, whole=True)),
        "window_output_tokens": {"decode": decode_tokens, "prompt": prompt_tokens},
        "output_throughput_tok_s": (decode_tokens + prompt_tokens) / window if window > 0 else 0.0,
        "errors": dict(errors.most_common()),
    }


def transfer_counters(before: Mapping[str, float] | None, after: Mapping[str, float] | None,
                      num_prompts: int) -> dict[str, dict[str, float]]:
    """``name -> {delta, per_prompt}`` for the counters named "*transfer*" that grew."""
    if before is None or after is None:
        return {}
    deltas = {name: value - before.get(name, 0.0) for name, value in sorted(after.items())
              if "transfer" in name and not name.endswith("_created")}
    return {name: {"delta": delta, "per_prompt": delta / num_prompts} for name, delta in deltas.items() if delta > 0}


async def _send(client: httpx.AsyncClient, url: str, payload: dict[str, Any], stream: Stream, start: float,
                ended: asyncio.Event | None = None) -> None:
    stream.sent_at = time.perf_counter() - start
    try:
        await send_request(client, url, payload, stream.record)
    finally:
        if ended is not None:
            ended.set()  # a decode that failed or finished is not waited for


async def run_interference(config: InterferenceConfig, command: str | None = None) -> dict[str, Any]:
    """Run the measurement against ``config.base_url``; returns the results document."""
    rng = random.Random(config.seed)
    ids = random_prompts([config.decode_prompt_len] * config.decodes + [config.prompt_len] * config.num_prompts,
                         config.vocab_size, rng)
    base_url = config.base_url.rstrip("/")
    url = f"{base_url}{COMPLETIONS}"
    async with http_client(config.request_timeout_s) as client:
        model = config.model or await resolve_model(client, base_url)
        start = time.perf_counter()
        streaming = [asyncio.Event() for _ in range(config.decodes)]
        decodes = [Stream("decode", RequestRecord(i, config.decode_prompt_len, itl=_GapLog(on_first=event.set)))
                   for i, event in enumerate(streaming)]
        decode_tasks = [asyncio.create_task(_send(client, url, _payload(model, ids[i], config.decode_output_len),
                                                  stream, start, streaming[i]))
                        for i, stream in enumerate(decodes)]
        try:
            await asyncio.gather(*(event.wait() for event in streaming))
            streaming_at = time.perf_counter() - start
            await asyncio.sleep(config.baseline_s)
            before = await scrape_metrics(client, base_url)
            prompts = [Stream("prompt", RequestRecord(i, config.prompt_len)) for i in range(config.num_prompts)]
            offsets = arrival_offsets(inter_arrival_gaps(config.num_prompts, config.request_rate, config.seed))
            prompt_tasks = []
            async for index in paced(range(config.num_prompts), offsets):
                payload = _payload(model, ids[config.decodes + index], config.prompt_output_len)
                prompt_tasks.append(asyncio.create_task(_send(client, url, payload, prompts[index], start)))
            await asyncio.gather(*prompt_tasks)
            after = await scrape_metrics(client, base_url) if before is not None else None
        finally:
            for stream, task in zip(decodes, decode_tasks, strict=True):
                stream.ended_by_server = task.done()
                task.cancel()
            await asyncio.gather(*decode_tasks, return_exceptions=True)
    rate = "inf" if math.isinf(config.request_rate) else config.request_rate  # JSON has no Infinity
    return {"kvloom_bench": "interference", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": command or shlex.join(sys.argv), "base_url": base_url, "model": model,
            "parameters": asdict(config) | {"request_rate": rate},
            **analyse(decodes, prompts, streaming_at),
            "transfer_counters": transfer_counters(before, after, config.num_prompts),
            "streams": [stream.to_json() for stream in (*decodes, *prompts)]}


def format_report(result: Mapping[str, Any]) -> str:
    """The printed table of a results document."""
    width = 60
    counts, tokens, parameters = result["counts"], result["window_output_tokens"], result["parameters"]
    ttft, e2e = result["prompt_ttft_ms"], result["prompt_e2e_ms"]
    rows: list[tuple[str, str]] = [
        ("Decodes streaming / asked:", f"{counts['decodes_streaming']} / {counts['decodes']}"),
        ("Decodes failed / ended early:", f"{counts['decodes_failed']} / {counts['decodes_ended_early']}"),
        ("Long prompts completed / failed:", f"{counts['prompts_completed']} / {counts['prompts_failed']}"),
        ("Window (s):", f"{result['window_s']:.2f}"),
        ("Output tokens in window (decode / long):", f"{tokens['decode']} / {tokens['prompt']}"),
        ("Output token throughput (tok/s):", f"{result['output_throughput_tok_s']:.2f}"),
        (f"-Long prompts ({parameters['prompt_len']} tokens, {parameters['request_rate']}/s)-", ""),
        ("Mean / P50 / P99 TTFT (ms):", f"{ttft['mean']:.1f} / {ttft['median']:.1f} / {ttft['p99']:.1f}"),
        ("Mean / P50 / P99 E2E (ms):", f"{e2e['mean']:.1f} / {e2e['median']:.1f} / {e2e['p99']:.1f}")]
    for title, key in (("in the window", "decode_itl_ms"),
                       (f"baseline, {result['baseline_s']:.1f} s alone", "decode_itl_baseline_ms")):
        itl = result[key]
        rows += [(f"-Decode ITL, {title} ({itl['count']} gaps)-", ""),
                 ("Mean / P50 / P99 / Max ITL (ms):",
                  f"{itl['mean']:.1f} / {itl['median']:.1f} / {itl['p99']:.1f} / {itl['max']:.1f}")]
    if result.get("transfer_counters"):
        rows.append(("-Server transfer counters (delta / per long prompt)-", ""))
        rows += [(f"{name}:", f"{c['delta']:.3f} s / {1e3 * c['per_prompt']:.2f} ms" if "seconds" in name
                  else f"{c['delta']:.6g} / {c['per_prompt']:.6g}")
                 for name, c in result["transfer_counters"].items()]
    lines = [" Interference Benchmark Result ".center(width, "=")]
    for label, value in rows:
        lines.append(label.center(width, "-") if not value else
                     f"{label:<{width - len(value) - 1}} {value}" if len(label) + len(value) < width else
                     f"{label} {value}")
    lines += [f"error x{count}: {message[:200]}" for message, count in result["errors"].items()]
    if counts["decodes_ended_early"] > counts["decodes_failed"]:
        lines.append("warning: decodes finished before the long prompts did; raise --decode-output-len")
    lines.append("=" * width)
    return "\n".join(lines)
