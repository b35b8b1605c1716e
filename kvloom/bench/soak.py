"""`kvloom bench soak`: ordinary, impatient and hostile clients against one server.

A kvloom server starts in this process (loopback only, a free port) on a KV pool
``pool_factor`` times too small for the load, so preemption never stops. ``num_requests``
requests (bounded by ``max_seconds`` too) go out ``concurrency`` at a time, drawn with
a seed:

- 65% ordinary: random sampling parameters (greedy or sampled with a seed, top-p/k,
  penalties), random stop strings, random structured constraints (choice, regex,
  JSON object);
- 20% streaming clients that disconnect after a few chunks;
- 10% aborted: the client gives up after a random short wait;
- 5% hostile: payloads that once killed the engine or must be refused (seeds past
  64 bits, an explosive regex, infinite temperature, lone surrogates, ...).

With ``endpoints="all"`` the non-hostile requests spread over the chat completions
(tools with every ``tool_choice``, JSON schemas, ``n``, logprobs, beam search), Anthropic's
Messages and the Responses APIs as well as the legacy completions, embeddings and /pooling (pooling
requests beside the generating ones) and SageMaker's ``/invocations``, each answer compared
without its ids and timestamps.

With ``lora_modules`` (the engine needs ``enable_lora``), half of the non-hostile
requests name one of the adapters, drawn evenly: with more adapters than the engine's
``max_loras`` slots, loads and evictions run under preemption and aborts too.

Reported: requests lost (an ordinary request without a complete answer: must be 0),
requests failed and why (only hostile ones should), KV blocks leaked after the run
(``check_integrity()`` on the engine thread; must be 0), engine faults (must be 0),
and for the greedy ordinary requests, how many outputs equal the same request sent
again alone afterwards (all of them, since tokens do not depend on the batch).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

KINDS = (("ordinary", 0.65), ("stream_disconnect", 0.20), ("abort", 0.10), ("hostile", 0.05))
WORDS = ("the cat sat on a warm mat while rain fell over quiet hills and rivers ran to the sea "
         "models learn patterns from text numbers like 42 and 1999 appear often").split()
HOSTILE: list[dict[str, Any]] = [
    {"seed": 2 ** 80}, {"seed": -(2 ** 70)}, {"seed": 2 ** 64},
    {"guided_regex": "(a{1000}){1000}"}, {"temperature": "inf"}, {"stop_token_ids": [10 ** 7]},
    {"stop": ["x"] * 500}, {"max_tokens": -5}, {"top_p": 0}, {"prompt": ""}, {"n": 10 ** 6},
    {"logprobs": 10 ** 9}, {"guided_json": {"type": "bogus"}}, {"guided_grammar": "root ::= ("},
]
RAW_HOSTILE = ['{"prompt": "a \\ud800 b", "max_tokens": 2}', '{"prompt": "Hi", "temperature": 1e309}',
               '{"prompt": ', "[1, 2, 3]", '{"prompt": {"nested": [[[[]]]]}}']


@dataclass(frozen=True)
class SoakConfig:
    model: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    num_requests: int = 1000
    concurrency: int = 64
    max_seconds: float = 1800.0
    seed: int = 0
    pool_factor: float = 5.0
    max_tokens: int = 48
    lora_modules: tuple[tuple[str, str], ...] = ()  # (served name, PEFT directory) each
    endpoints: str = "completions"  # or "all": chat, messages and responses too

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.concurrency < 1 or self.max_seconds <= 0 or self.pool_factor < 1:
            raise ValueError("num_requests and concurrency must be >= 1, max_seconds > 0, pool_factor >= 1")
        if self.endpoints not in ENDPOINT_MIXES:
            raise ValueError(f"endpoints must be one of {sorted(ENDPOINT_MIXES)}, got {self.endpoints!r}")


@dataclass(frozen=True)
class SoakRequest:
    kind: str  # one of KINDS
    path: str  # the endpoint
    payload: dict[str, Any] | str  # str: raw hostile text
    greedy: bool  # an ordinary request whose answer is deterministic: compared with it sent alone


@dataclass
class SoakRecord:
    index: int
    kind: str
    outcome: str = "lost"  # ok | refused | disconnected | aborted | failed | lost
    attempted: bool = False  # sent before the time bound ran out
    status: int | None = None
    reason: str | None = None  # the error code or message of a non-200 answer
    answer: Any = None  # the answer without ids and timestamps (``_answer``)


def _ordinary(rng: random.Random, max_tokens: int) -> tuple[dict[str, Any], bool]:
    payload: dict[str, Any] = {"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 120))),
                               "max_tokens": rng.randrange(4, max_tokens + 1), "ignore_eos": rng.random() < 0.5}
    greedy = rng.random() < 0.5
    if greedy:
        payload["temperature"] = 0.0
    else:
        payload.update(temperature=rng.choice([0.5, 0.8, 1.0, 1.3]), top_p=rng.choice([1.0, 0.9, 0.5]),
                       top_k=rng.choice([0, 5, 50]), seed=rng.randrange(-(2 ** 40), 2 ** 40),
                       presence_penalty=rng.choice([0.0, 0.5]), repetition_penalty=rng.choice([1.0, 1.2]))
    if rng.random() < 0.2:
        payload["stop"] = [rng.choice(WORDS) for _ in range(rng.randrange(1, 4))]
    roll = rng.random()
    if roll < 0.05:
        payload["guided_choice"] = [rng.choice(WORDS) + str(i) for i in range(rng.randrange(2, 50))]
    elif roll < 0.10:
        payload["guided_regex"] = "[a-z ]{1,30}"
    elif roll < 0.13:
        payload["response_format"] = {"type": "json_object"}
    return payload, greedy and "stop" not in payload


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 8}},
          "required": ["n"]}


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(low, high)))


def _chat(rng: random.Random, max_tokens: int) -> tuple[dict[str, Any], bool]:
    """A chat completion: one to three turns, maybe tools (every tool_choice), a JSON
    schema or object, n, logprobs, beam search."""
    messages = [{"role": "user", "content": _words(rng, 2, 60)}]
    if rng.random() < 0.2:
        messages += [{"role": "assistant", "content": _words(rng, 2, 30)},
                     {"role": "user", "content": _words(rng, 2, 30)}]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": _words(rng, 3, 10)})
    payload: dict[str, Any] = {"messages": messages, "max_tokens": rng.randrange(1, max_tokens + 1)}
    if rng.random() < 0.1:  # beam search: deterministic, and nothing else may be set
        return {**payload, "use_beam_search": True, "n": rng.randrange(1, 3), "temperature": 0.0}, True
    roll = rng.random()
    if roll < 0.2:
        payload.update(tools=TOOLS, tool_choice=rng.choice(["auto", "required", "none",
                                                            {"type": "function", "function": {"name": "add"}}]))
    elif roll < 0.3:
        payload["response_format"] = {"type": "json_object"}
    elif roll < 0.4:
        payload["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    if rng.random() < 0.3:
        payload["n"] = rng.randrange(1, 4)
    if rng.random() < 0.3:
        payload.update(logprobs=True, top_logprobs=rng.randrange(0, 5))
    greedy = rng.random() < 0.5
    if greedy:
        payload["temperature"] = 0.0
    else:
        payload.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(2 ** 31), top_p=rng.choice([1.0, 0.9]))
    return payload, greedy


def _messages(rng: random.Random, max_tokens: int) -> tuple[dict[str, Any], bool]:
    payload: dict[str, Any] = {"messages": [{"role": "user", "content": _words(rng, 2, 60)}],
                               "max_tokens": rng.randrange(1, max_tokens + 1), "temperature": 0.0}
    if rng.random() < 0.3:
        payload["system"] = _words(rng, 3, 10)
    if rng.random() < 0.3:
        payload["tools"] = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    return payload, True


def _responses(rng: random.Random, max_tokens: int) -> tuple[dict[str, Any], bool]:
    return {"input": _words(rng, 2, 60), "max_output_tokens": rng.randrange(1, max_tokens + 1),
            "temperature": 0.0}, True


def _embeddings(rng: random.Random, max_tokens: int) -> tuple[dict[str, Any], bool]:
    """One to four texts to embed: pooling requests among the generating ones."""
    texts = [_words(rng, 1, 60) for _ in range(rng.randrange(1, 5))]
    return {"input": texts if len(texts) > 1 else texts[0], "encoding_format": "float"}, True


def _pooling(rng: random.Random, max_tokens: int) -> tuple[dict[str, Any], bool]:
    """A text's vector per token (vLLM's /pooling, token_embed): every prompt position
    computed, across chunks and preemptions, beside the generating requests."""
    return {"input": _words(rng, 1, 60), "task": rng.choice(["token_embed", "embed"])}, True


def _invocations(rng: random.Random, max_tokens: int) -> tuple[dict[str, Any], bool]:
    """SageMaker's route: a completion's or a chat's body, answered as on its own route."""
    return (_ordinary if rng.random() < 0.5 else _chat)(rng, max_tokens)


# Each mix: (path, weight, draw) for the non-hostile requests.
ENDPOINT_MIXES = {
    "completions": (("/v1/completions", 1.0, _ordinary),),
    "all": (("/v1/completions", 0.3, _ordinary), ("/v1/chat/completions", 0.4, _chat),
            ("/v1/messages", 0.15, _messages), ("/v1/responses", 0.15, _responses),
            ("/v1/embeddings", 0.05, _embeddings), ("/invocations", 0.05, _invocations),
            ("/pooling", 0.05, _pooling)),
}


def _draw(rng: random.Random, config: SoakConfig) -> SoakRequest:
    kind = rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS])[0]
    if kind == "hostile":
        if rng.random() < 0.3:
            return SoakRequest(kind, "/v1/completions", rng.choice(RAW_HOSTILE), False)
        return SoakRequest(kind, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **rng.choice(HOSTILE)}, False)
    mix = ENDPOINT_MIXES[config.endpoints]
    # One endpoint draws nothing here: a seed plans the runs it planned before the mixes.
    path, _, draw = mix[0] if len(mix) == 1 else rng.choices(mix, weights=[weight for _, weight, _ in mix])[0]
    payload, greedy = draw(rng, config.max_tokens)
    if config.lora_modules and rng.random() < 0.5:
        payload["model"] = rng.choice(config.lora_modules)[0]  # over the served model's name
    return SoakRequest(kind, path, payload, greedy and kind == "ordinary")


async def _send(client: httpx.AsyncClient, model: str, record: SoakRecord, url: str,
                payload: dict[str, Any] | str, rng: random.Random) -> None:
    if isinstance(payload, str):  # raw hostile text: not even JSON, or JSON with bad escapes
        response = await client.post(url, content=payload.encode("utf-8", "surrogatepass"),
                                     headers={"Content-Type": "application/json"})
        _finish(record, url, response.status_code, response.text)
        return
    body = {"model": model, **payload}
    if record.kind == "stream_disconnect":
        async with client.stream("POST", url, json={**body, "stream": True}) as response:
            record.status = response.status_code
            lines = 0
            async for _ in response.aiter_lines():
                lines += 1
                if lines >= rng.randrange(1, 8):
                    break
        record.outcome = "disconnected"
        return
    if record.kind == "abort":
        try:
            response = await asyncio.wait_for(client.post(url, json=body), timeout=rng.uniform(0.05, 1.5))
        except asyncio.TimeoutError:
            record.outcome = "aborted"
            return
        _finish(record, url, response.status_code, response.text)
        return
    response = await client.post(url, json=body)
    _finish(record, url, response.status_code, response.text)


FINISHED = {"stop", "length", "tool_calls", "end_turn", "max_tokens", "tool_use", "stop_sequence",
            "completed", "incomplete"}  # the endings of a complete answer, per API
VOLATILE = {"id", "created", "created_at", "completed_at", "call_id", "system_fingerprint"}  # differ per answer


def _answer(path: str, data: dict[str, Any]) -> tuple[bool, Any]:
    """Whether an answer of ``path`` is complete, and its content without ids and timestamps."""
    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in VOLATILE and not k.endswith("_id")}
        return [strip(v) for v in value] if isinstance(value, list) else value

    if path in ("/v1/embeddings", "/pooling"):
        return True, data["data"]
    if path == "/v1/messages":
        return data.get("stop_reason") in FINISHED, strip(data["content"])
    if path == "/v1/responses":
        return data.get("status") in FINISHED, strip(data["output"])
    choices = data["choices"]
    complete = all(choice.get("finish_reason") in FINISHED for choice in choices)
    if path == "/v1/completions" or (path == "/invocations" and "text" in choices[0]):
        return complete, choices[0].get("text")
    return complete, strip([choice["message"] for choice in choices])


def _finish(record: SoakRecord, path: str, status: int, text: str) -> None:
    record.status = status
    if status == 200:
        complete, record.answer = _answer(path, json.loads(text))
        record.outcome = "ok" if complete else "failed"
        return
    try:
        error = json.loads(text)["error"]
        record.reason = f"{error.get('code')}: {error.get('message', '')[:70]}"
    except (ValueError, KeyError, TypeError):
        record.reason = f"non-JSON error body: {text[:80]!r}"
    record.outcome = "refused" if record.kind == "hostile" and 400 <= status < 500 else "failed"


async def _load(base_url: str, model: str, config: SoakConfig) -> list[SoakRecord]:
    plan = plan_requests(config)
    records = [SoakRecord(index, item.kind) for index, item in enumerate(plan)]
    deadline = time.monotonic() + config.max_seconds
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(len(plan)):
        queue.put_nowait(index)

    async def worker(client: httpx.AsyncClient, worker_rng: random.Random) -> None:
        while not queue.empty() and time.monotonic() < deadline:
            index = queue.get_nowait()
            item = plan[index]
            record = records[index]
            record.attempted = True
            try:
                await _send(client, model, record, item.path, item.payload, worker_rng)
            except (httpx.HTTPError, ValueError) as error:  # a broken answer: the request is lost
                record.outcome, record.reason = "lost", f"{type(error).__name__}: {error}"[:120]

    limits = httpx.Limits(max_connections=config.concurrency * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        await asyncio.gather(*(worker(client, random.Random(config.seed * 1000 + w))
                               for w in range(config.concurrency)))
    return [r for r in records if r.attempted]


async def _alone(base_url: str, model: str, plan: list[SoakRequest],
                 records: list[SoakRecord]) -> tuple[int, int, list[int]]:
    """Send each completed greedy request again, one at a time: (equal, compared, differing indices)."""
    greedy = [r for r in records if plan[r.index].greedy and r.outcome == "ok"]
    differing = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        for record in greedy:
            item = plan[record.index]
            assert isinstance(item.payload, dict)
            response = await client.post(item.path, json={"model": model, **item.payload})
            if response.status_code != 200 or _answer(item.path, response.json())[1] != record.answer:
                differing.append(record.index)
    return len(greedy) - len(differing), len(greedy), differing


def plan_requests(config: SoakConfig) -> list[SoakRequest]:
    """Every request of the run, from the seed."""
    rng = random.Random(config.seed)
    return [_draw(rng, config) for _ in range(config.num_requests)]


def _size(tokenizer: Any, payload: dict[str, Any] | str) -> int:
    """A non-hostile request's tokens at its longest: its texts, what a chat template adds
    (40 bounds the default model's) and a tool list (300), and its output."""
    assert isinstance(payload, dict)
    if "prompt" in payload:
        return len(tokenizer.encode(payload["prompt"])) + payload["max_tokens"]
    given = payload.get("input", "")
    texts = ([given] if isinstance(given, str) else given) + [payload.get("system", "")]
    texts += [m["content"] for m in payload.get("messages", [])]
    outputs = payload.get("max_tokens") or payload.get("max_output_tokens") or 1  # an embedding: its one token
    return sum(len(tokenizer.encode(text)) for text in texts) + 40 + 300 * ("tools" in payload) + outputs


def pool_blocks(config: SoakConfig, token_counts: list[int], block_size: int = 16) -> int:
    """A pool ``pool_factor`` times smaller than the load's demand (``concurrency``
    requests of the average size at once, each at its longest), but large enough for
    the largest single request."""
    blocks = [-(-tokens // block_size) for tokens in token_counts]
    demand = config.concurrency * sum(blocks) / len(blocks)
    return max(max(blocks) + 1, int(demand / config.pool_factor))


def run_soak(config: SoakConfig) -> dict[str, Any]:
    from kvloom.config import EngineConfig, ModelConfig
    from kvloom.engine.engine import LLMEngine
    from kvloom.models.loader import load_checkpoint
    from kvloom.server.background import start_background_server
    from kvloom.server.settings import ServerSettings

    revision = config.engine_kwargs.get("revision")
    checkpoint = load_checkpoint(config.model, revision=revision)  # weights stay unread
    tokenizer = checkpoint.tokenizer
    # 2,048 tokens of context at most (the pool is sized for the plan, not the context).
    max_model_len = min(2048, ModelConfig.from_hf(checkpoint.hf_config).max_position_embeddings)
    plan = plan_requests(config)
    counts = [_size(tokenizer, item.payload) for item in plan if item.kind != "hostile"]
    num_blocks = pool_blocks(config, counts)
    engine_config = EngineConfig.from_kwargs(config.model, **{"num_blocks": num_blocks, "max_model_len": max_model_len,
                                                               **config.engine_kwargs})
    settings = ServerSettings(served_model_name="soak", lora_modules=config.lora_modules,
                              enable_auto_tool_choice=True, tool_call_parser="hermes")
    server = start_background_server(lambda: LLMEngine(engine_config), settings)
    try:
        started = time.monotonic()
        records = asyncio.run(_load(server.base_url, "soak", config))
        load_seconds = time.monotonic() - started
        snapshot = server.wait_until_idle(timeout=120)  # check_integrity() ran on the engine thread
        equal, compared, differing = asyncio.run(_alone(server.base_url, "soak", plan, records))
        metrics = httpx.get(f"{server.base_url}/metrics").text
        preemptions = next((float(line.split()[-1]) for line in metrics.splitlines()
                            if line.startswith("kvloom:num_preemptions_total ")), None)
        window_freed = next((float(line.split()[-1]) for line in metrics.splitlines()
                             if line.startswith("kvloom:num_window_freed_blocks_total ")), None)
        engine_faults = 0 if server.async_engine.engine_error is None else 1
    finally:
        server.stop()
    outcomes = Counter(r.outcome for r in records)
    return {
        "config": asdict(config), "num_blocks": num_blocks, "seconds": round(load_seconds, 1),
        "sent": len(records), "outcomes": dict(outcomes),
        "by_kind": {kind: dict(Counter(r.outcome for r in records if r.kind == kind)) for kind, _ in KINDS},
        "lost": outcomes.get("lost", 0) + outcomes.get("failed", 0),
        "failures": dict(Counter(f"{r.kind}: {r.status} {r.reason}" for r in records
                                 if r.outcome in ("refused", "failed", "lost")).most_common()),
        "kv_blocks_leaked": snapshot.num_blocks - snapshot.num_available_blocks,
        "engine_faults": engine_faults, "preemptions": preemptions, "window_freed_blocks": window_freed,
        "greedy_equal_alone": equal, "greedy_compared": compared, "greedy_differing": differing[:20],
    }


def format_soak(result: dict[str, Any]) -> str:
    lines = [f"soak: {result['sent']} requests in {result['seconds']} s on a pool of {result['num_blocks']} blocks",
             f"  outcomes: {result['outcomes']}"]
    lines += [f"    {kind}: {counts}" for kind, counts in result["by_kind"].items()]
    lines += [f"  requests lost: {result['lost']}", f"  KV blocks leaked: {result['kv_blocks_leaked']}",
              f"  engine faults: {result['engine_faults']}", f"  preemptions: {result['preemptions']}",
              f"  KV blocks let go behind a sliding window: {result.get('window_freed_blocks')}",
              f"  greedy outputs equal to the request run alone: {result['greedy_equal_alone']} / "
              f"{result['greedy_compared']}", "  refused or failed, by reason:"]
    lines += [f"    {count:5d}  {reason}" for reason, count in result["failures"].items()]
    return "\n".join(lines)
