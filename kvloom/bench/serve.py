"""`kvloom bench serve`: an asyncio load generator for OpenAI-compatible servers.

It speaks only the OpenAI protocol (streamed /v1/completions or
/v1/chat/completions with ``stream_options.include_usage``), so the same workload
runs against kvloom, vLLM, SGLang or llama.cpp. Requests arrive by a seeded
Poisson process (see ``arrivals``), optionally capped by a concurrency
semaphore; multi-turn conversations arrive that way too, and each sends turn
``i + 1`` once turn ``i`` completed, its history holding the dataset's replies or
(``history="generated"``) the server's own, as a chat client sends them. A failed request (HTTP error, broken or
malformed stream) is recorded with its error and never stops the run.

Metric definitions are in ``kvloom.bench.metrics``. The results JSON holds the
workload fingerprint (a hash of the request list and the parameters that shape
the load, not of the server), so runs against different engines can be checked
to have measured the same thing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import httpx
from tqdm import tqdm

from kvloom.bench.arrivals import arrival_offsets, inter_arrival_gaps, paced
from kvloom.bench.datasets import BenchRequest
from kvloom.bench.metrics import (
    BenchMetrics,
    RequestRecord,
    compute_metrics,
    counter_deltas,
    format_report,
    parse_prometheus,
)

__all__ = ["ServeBenchConfig", "build_payload", "report", "resolve_model", "run_benchmark",
           "save_result", "scrape_metrics", "send_request", "workload_fingerprint"]

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
RESULT_FORMAT_VERSION = 1


@dataclass(frozen=True)
class ServeBenchConfig:
    """Everything that shapes a run besides the request list."""

    base_url: str
    endpoint: str = COMPLETIONS
    model: str | None = None  # None: the first id of GET /v1/models
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = False
    temperature: float = 0.0
    num_warmups: int = 0
    slo: dict[str, float] = field(default_factory=dict)  # ms, keys ttft / tpot / e2el
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_timeout_s: float = 6 * 3600.0
    label: str | None = None
    workload: dict[str, Any] = field(default_factory=dict)  # dataset parameters, for the record
    show_progress: bool = True
    # Multi-turn history: each turn's earlier replies as the dataset has them (every
    # engine gets the same prompts), or as this server generated them (what a chat client
    # sends, so that the whole history can be a prefix-cache hit).
    history: str = "dataset"

    def __post_init__(self) -> None:
        if self.endpoint not in (COMPLETIONS, CHAT):
            raise ValueError(f"endpoint must be {COMPLETIONS} or {CHAT}, got {self.endpoint!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")
        if self.history not in HISTORIES:
            raise ValueError(f"history must be one of {', '.join(HISTORIES)}, got {self.history!r}")

    def load_parameters(self) -> dict[str, Any]:
        """The parameters that, with the requests, define the workload (JSON-safe)."""
        parameters = {"endpoint": self.endpoint, "request_rate": _json_number(self.request_rate),
                      "burstiness": self.burstiness, "max_concurrency": self.max_concurrency,
                      "seed": self.seed, "ignore_eos": self.ignore_eos, "temperature": self.temperature,
                      "extra_body": self.extra_body, "workload": self.workload}
        if self.history != "dataset":  # only then: earlier runs' fingerprints stay as they were
            parameters["history"] = self.history
        return parameters


def _json_number(value: float) -> float | str:
    return "inf" if math.isinf(value) else value  # JSON has no Infinity


def workload_fingerprint(requests: Sequence[BenchRequest], parameters: Mapping[str, Any]) -> str:
    """sha256 of the request list and the load parameters (canonical JSON)."""
    body = {"requests": [[r.prompt, r.prompt_len, r.expected_output_len, r.group, r.turn]
                         for r in requests], "parameters": parameters}
    text = json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------- one request
def build_payload(request: BenchRequest, config: ServeBenchConfig, model: str) -> dict[str, Any]:
    """The JSON body for ``request``; text prompts become one user message on chat."""
    payload: dict[str, Any] = {
        "model": model, "max_tokens": request.expected_output_len,
        "temperature": config.temperature, "stream": True,
        "stream_options": {"include_usage": True}}
    if config.endpoint == CHAT:
        payload["messages"] = (request.prompt if isinstance(request.prompt, list)
                               else [{"role": "user", "content": request.prompt}])
    elif isinstance(request.prompt, list):
        raise ValueError("chat-message prompts (multiturn) need --endpoint /v1/chat/completions")
    else:
        payload["prompt"] = request.prompt
    if config.ignore_eos:
        payload["ignore_eos"] = True  # vLLM's extension; only sent when asked for
    payload.update(config.extra_body)
    return payload


def _error_message(text: str) -> str:
    """The message of an OpenAI-style error body (``{"error": {"message": ...}}``), else the text."""
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:300]
    detail = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(detail, dict):
        detail = detail.get("message") or detail.get("detail") or detail
    return str(detail).strip()[:300]


def _chunk_text(choice: Mapping[str, Any]) -> str:
    """Generated text in a streamed choice: ``text`` (completions) or the delta's
    ``content`` / ``reasoning_content`` (chat)."""
    if isinstance(choice.get("text"), str):
        return choice["text"]
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def send_request(client: httpx.AsyncClient, url: str, payload: Mapping[str, Any],
                       record: RequestRecord, text: list[str] | None = None) -> RequestRecord:
    """POST ``payload`` and fill ``record`` from the SSE stream; never raises for
    request failures (they land in ``record.error``). ``text``, if given, receives the
    generated text's pieces."""
    start = time.perf_counter()
    last_token_time: float | None = None
    text_chunks, finished, done = 0, False, False
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                record.error = f"HTTP {response.status_code}: {_error_message(body)}"
                return record
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue  # blank separators, ": keep-alive" comments, "event:" fields
                data_text = line[5:].strip()
                if data_text == "[DONE]":
                    done = True
                    break
                data = json.loads(data_text)
                if not isinstance(data, dict):
                    raise ValueError(f"stream data is not an object: {data_text[:100]}")
                if data.get("error"):
                    record.error = f"stream error: {_error_message(data_text)}"
                    return record
                choices = data.get("choices") or []
                if choices:
                    piece = _chunk_text(choices[0])
                    if piece:
                        if text is not None:
                            text.append(piece)
                        # TTFT and ITL count chunks that carry text, not role-only or empty ones.
                        if last_token_time is None:
                            record.ttft = now - start
                        else:
                            record.itl.append(now - last_token_time)
                        last_token_time, text_chunks = now, text_chunks + 1
                    if choices[0].get("finish_reason") is not None:
                        finished = True
                        if record.ttft is None:  # e.g. EOS first: a token came, no text
                            record.ttft = now - start
                usage = data.get("usage")
                if usage:
                    record.usage_reported = True
                    record.output_len = int(usage.get("completion_tokens") or 0)
                    if usage.get("prompt_tokens") is not None:
                        record.server_prompt_tokens = int(usage["prompt_tokens"])
            record.e2e = time.perf_counter() - start
        if not (done or finished):
            record.error = "stream ended before the response finished"
        elif not record.usage_reported:
            record.output_len = text_chunks  # a chunk per token is the common case
    except Exception as error:  # noqa: BLE001 - any failure is one failed request, not a dead run
        record.error = f"{type(error).__name__}: {error}"[:300]
    finally:
        if record.e2e is None:
            record.e2e = time.perf_counter() - start
    return record


# ---------------------------------------------------------------- the server's side
async def scrape_metrics(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """GET {base}/metrics parsed, or None when the server has none (404) or fails."""
    try:
        response = await client.get(f"{base_url}/metrics", timeout=30.0)
    except (httpx.HTTPError, OSError):
        return None
    if response.status_code != 200:
        return None
    return parse_prometheus(response.text)


def http_client(request_timeout_s: float) -> httpx.AsyncClient:
    """The load generators' client. No pool cap: httpx's default of 100 connections
    would silently bound concurrency."""
    return httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=60.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def resolve_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id the server lists, as vLLM's client picks one."""
    try:
        response = await client.get(f"{base_url}/v1/models", timeout=60.0)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, OSError, ValueError, KeyError, IndexError) as error:
        raise ValueError(f"cannot list models at {base_url}/v1/models ({error}); pass --model") from None


# ---------------------------------------------------------------- the run
HISTORIES = ("dataset", "generated")


def with_replies(request: BenchRequest, replies: Sequence[str]) -> BenchRequest:
    """``request`` (a multi-turn chat's turn ``len(replies)``) with its assistant
    messages replaced by ``replies``, in order."""
    if not isinstance(request.prompt, list):
        raise ValueError("only chat-message prompts (multiturn) have replies to replace")
    messages = [dict(message) for message in request.prompt]
    answers = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    if len(answers) != len(replies):
        raise ValueError(f"turn {request.turn} has {len(answers)} earlier replies, got {len(replies)}")
    for index, reply in zip(answers, replies, strict=True):
        messages[index]["content"] = reply
    return dataclasses.replace(request, prompt=messages)


def _units(requests: Sequence[BenchRequest]) -> list[list[int]]:
    """Arrival units as request indices: conversations (turns in order) when the
    requests carry turns, else one request each."""
    if not any(r.turn is not None for r in requests):
        return [[i] for i in range(len(requests))]
    conversations: dict[int | None, list[int]] = {}
    for index, request in enumerate(requests):
        conversations.setdefault(request.group, []).append(index)
    return [sorted(indices, key=lambda i: requests[i].turn or 0) for indices in conversations.values()]


async def _warm_up(client: httpx.AsyncClient, url: str, config: ServeBenchConfig, model: str,
                   requests: Sequence[BenchRequest]) -> int:
    """Send ``num_warmups`` requests (the workload's first ones, cycled); returns failures."""
    semaphore = asyncio.Semaphore(config.max_concurrency or max(1, config.num_warmups))

    async def one(index: int) -> bool:
        request = requests[index % len(requests)]
        async with semaphore:
            record = await send_request(client, url, build_payload(request, config, model),
                                        RequestRecord(index, request.prompt_len))
        return record.success

    results = await asyncio.gather(*(one(i) for i in range(config.num_warmups)))
    return results.count(False)


@dataclass(slots=True)
class TimedRun:
    records: list[RequestRecord]  # the finished requests' (all of them unless interrupted)
    duration_s: float
    num_requests: int  # in the workload
    interrupted: bool = False  # Ctrl-C: the run stopped early; records holds the finished ones


async def _timed_run(client: httpx.AsyncClient, url: str, config: ServeBenchConfig, model: str,
                     requests: Sequence[BenchRequest]) -> TimedRun:
    """Send the workload on its arrival schedule. Interrupted (Ctrl-C cancels the run),
    it cancels what is in flight and keeps the finished requests, for a partial report."""
    records = [RequestRecord(i, r.prompt_len, group=r.group, turn=r.turn) for i, r in enumerate(requests)]
    finished: list[int] = []
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    progress = tqdm(total=len(requests), disable=not config.show_progress, desc="requests")
    start = time.perf_counter()

    async def send(index: int, replies: list[str] | None) -> str:
        """Send request ``index`` (with ``replies`` as its earlier turns' answers, when
        given); returns the text it generated when ``replies`` is given, else ""."""
        request = requests[index] if replies is None else with_replies(requests[index], replies)
        payload = build_payload(request, config, model)
        text: list[str] | None = None if replies is None else []
        async with semaphore or contextlib.nullcontext():
            # Latency starts once a slot is free: waiting in the client is not the server's.
            records[index].start_time = time.perf_counter() - start
            await send_request(client, url, payload, records[index], text)
        if replies is not None:
            # The dataset's count no longer describes the prompt sent; the server's does.
            records[index].prompt_len = records[index].server_prompt_tokens or request.prompt_len
        finished.append(index)
        progress.update(1)
        return "".join(text or ())

    async def unit(indices: list[int]) -> None:
        replies = [] if config.history == "generated" and requests[indices[0]].turn is not None else None
        for index in indices:  # a conversation's next turn waits for the previous one
            reply = await send(index, replies)
            if replies is not None:
                replies.append(reply)

    units = _units(requests)
    offsets = arrival_offsets(inter_arrival_gaps(len(units), config.request_rate, config.seed,
                                                 config.burstiness))
    tasks: list[asyncio.Task[None]] = []
    try:
        async for indices in paced(units, offsets, start):
            tasks.append(asyncio.create_task(unit(indices)))
        await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return TimedRun([records[i] for i in sorted(finished)], time.perf_counter() - start, len(requests),
                        interrupted=True)
    finally:
        progress.close()
    return TimedRun(records, time.perf_counter() - start, len(requests))


async def run_benchmark(config: ServeBenchConfig, requests: Sequence[BenchRequest],
                        command: str | None = None) -> dict[str, Any]:
    """Run the workload against ``config.base_url``; returns the results document
    (``command``: the command line to record, default ``sys.argv``)."""
    if not requests:
        raise ValueError("the workload has no requests")
    base_url = config.base_url.rstrip("/")
    url = f"{base_url}{config.endpoint}"
    async with http_client(config.request_timeout_s) as client:
        model = config.model or await resolve_model(client, base_url)
        build_payload(requests[0], config, model)  # a bad endpoint/dataset pairing fails here, once
        warmup_failures = await _warm_up(client, url, config, model, requests)
        if warmup_failures:
            print(f"warning: {warmup_failures}/{config.num_warmups} warm-up requests failed",
                  file=sys.stderr)
        # Scraped after the warm-ups, so the counters cover the timed run only.
        before = await scrape_metrics(client, base_url)
        run = await _timed_run(client, url, config, model, requests)
        after = await scrape_metrics(client, base_url) if before is not None else None
    records = run.records
    metrics = compute_metrics(records, run.duration_s, config.slo)
    parameters = config.load_parameters()
    return {
        "kvloom_bench": "serve", "format_version": RESULT_FORMAT_VERSION,
        "label": config.label, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command or shlex.join(sys.argv), "base_url": base_url, "model": model,
        "fingerprint": workload_fingerprint(requests, parameters), "parameters": parameters,
        "num_warmups": config.num_warmups, "warmup_failures": warmup_failures,
        "slo_ms": config.slo, "metrics": metrics.to_json(),
        "server_counters": counter_deltas(before, after),
        "interrupted": ({"finished": len(records), "of": run.num_requests} if run.interrupted else None),
        "requests": [record.to_json() for record in records],
    }


def report(result: Mapping[str, Any]) -> str:
    """The printed table for a results document from ``run_benchmark``."""
    title = "Serving Benchmark Result" + (f" ({result['label']})" if result.get("label") else "")
    interrupted = result.get("interrupted")
    if interrupted:
        title += f" - INTERRUPTED: the {interrupted['finished']} of {interrupted['of']} requests that finished"
    return format_report(BenchMetrics.from_json(result["metrics"]), result.get("server_counters"), title)


def save_result(path: str, result: Mapping[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as file:
        json.dump(result, file, indent=1, allow_nan=False)  # strict JSON for other tools
        file.write("\n")

