"""Prefill/decode disaggregation: each generation request in two legs.

1. The prefill leg: the client's body with ``"stream": false``, without
   ``stream_options``, and with ``"kv_transfer_params": {"do_remote_decode": true}``
   goes to the prefill instance the routing policy picks by the routing key (cache_aware
   over the prefill pool, so its prefix cache keeps hitting). That instance computes the
   prompt's KV (it forces ``max_tokens`` to 1 itself), holds it for a decode instance,
   and answers with a top-level ``kv_transfer_params`` object, opaque to the router.
2. The decode leg: the client's body plus those ``kv_transfer_params`` goes to the least
   loaded decode instance, streamed or not as the client asked; its answer is the
   client's, through the same proxy as any request (retries, broken streams,
   disconnects, ``x-kvloom-worker``).

A prefill 4xx is the client's answer: the request itself is bad. When no prefill instance
is up (or all failed before answering), or one answered a 5xx, a broken body, or a 200
without ``kv_transfer_params``, the client's body goes to a decode instance without them,
and that instance prefills it itself: a fallback, counted by reason and logged. Requests
for prompt logprobs (``prompt_logprobs``, or ``echo`` with ``logprobs``) go straight to a
decode instance, which must compute the whole prompt to score it, and so do beam searches
(``use_beam_search``: the search's rounds are many one-token requests on that instance)
and Responses requests that continue from a ``previous_response_id``: its conversation is
stored on the decode instance that answered it, which alone can prefill the continuation,
so the request goes there (kvloom/router/stored_responses.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from starlette.responses import Response

from kvloom.router.config import RouterConfig
from kvloom.router.metrics import DisaggMetrics
from kvloom.router.policy import RoutingPolicy, make_policy
from kvloom.router.proxy import WORKER_HEADER, Forward, Proxy
from kvloom.router.stored_responses import StoredResponses, to_owner

logger = logging.getLogger(__name__)

KV_TRANSFER_PARAMS = "kv_transfer_params"
REMOTE_DECODE = {"do_remote_decode": True}  # asks a prefill instance to hold the KV for a decode one


class Disaggregation:
    """A disaggregated router's generation requests: the prefill leg, then the decode leg
    (or the decode leg alone). ``policy`` routes over the prefill pool."""

    def __init__(self, config: RouterConfig, proxy: Proxy, policy: RoutingPolicy,
                 metrics: DisaggMetrics, stored: StoredResponses) -> None:
        self.prefill = frozenset(config.prefill)
        self.decode = frozenset(config.decode)
        self.proxy = proxy
        self.policy = policy
        self.decode_policy = make_policy("least_loaded")  # decode has no prefix to follow
        self.metrics = metrics
        self.stored = stored

    async def generate(self, path: str, body: bytes, parsed: dict[str, Any] | None,
                       headers: Mapping[str, str], key: str) -> Response:
        """The client's answer to ``body`` (``parsed``: it as a JSON object, else None)."""
        if parsed is None:  # the decode instance's 400 says what is wrong with it
            self.metrics.skipped.labels("unreadable_body").inc()
            return await self._decode(path, body, headers, stream=False)
        stream = parsed.get("stream") is True
        if wants_prompt_logprobs(parsed):
            self.metrics.skipped.labels("prompt_logprobs").inc()
            return await self._decode(path, _without_kv_transfer(body, parsed), headers, stream)
        if parsed.get("use_beam_search") is True:  # a round's requests each prefill their own tail
            self.metrics.skipped.labels("beam_search").inc()
            return await self._decode(path, _without_kv_transfer(body, parsed), headers, stream)
        previous = parsed.get("previous_response_id") if path == "/v1/responses" else None
        if isinstance(previous, str):
            self.metrics.skipped.labels("previous_response").inc()
            return await self._decode(path, _without_kv_transfer(body, parsed), headers, stream,
                                      await self.stored.owner(previous, self.decode))
        self.metrics.requests.labels("prefill").inc()
        start = time.monotonic()
        answer = await self.proxy.try_forward(Forward(
            "POST", path, _encode(prefill_body(parsed)), headers, False,
            lambda candidates: self.policy.route(key, candidates), self.prefill))
        if answer is None:
            return await self._fallback(path, body, parsed, headers, stream, "no_prefill_worker",
                                        "no prefill instance is up")
        if 400 <= answer.status_code < 500:
            return answer
        worker = answer.headers.get(WORKER_HEADER, "?")
        if answer.status_code != 200:
            return await self._fallback(path, body, parsed, headers, stream, "prefill_error",
                                        f"prefill {worker} answered {answer.status_code}")
        params = _kv_transfer_params(bytes(answer.body))
        if params is None:
            return await self._fallback(path, body, parsed, headers, stream, "no_kv_transfer_params",
                                        f"prefill {worker} answered 200 without a {KV_TRANSFER_PARAMS} object")
        self.metrics.prefill_seconds.observe(time.monotonic() - start)
        return await self._decode(path, _encode({**parsed, KV_TRANSFER_PARAMS: params}), headers, stream)

    async def _fallback(self, path: str, body: bytes, parsed: dict[str, Any], headers: Mapping[str, str],
                        stream: bool, reason: str, detail: str) -> Response:
        self.metrics.fallbacks.labels(reason).inc()
        logger.warning("prefill leg failed (%s: %s); a decode instance prefills this request itself",
                       reason, detail)
        return await self._decode(path, _without_kv_transfer(body, parsed), headers, stream)

    async def _decode(self, path: str, body: bytes, headers: Mapping[str, str], stream: bool,
                      owner: str | None = None) -> Response:
        """The decode leg: to the least loaded decode instance, or to ``owner`` (the one
        that stored the response a Responses request continues from)."""
        self.metrics.requests.labels("decode").inc()
        return await self.proxy.forward(Forward(
            "POST", path, body, headers, stream,
            to_owner(owner, lambda candidates: self.decode_policy.route("", candidates)), self.decode))


def wants_prompt_logprobs(body: Mapping[str, Any]) -> bool:
    """Whether the request scores its prompt: ``prompt_logprobs`` set (0 included), or
    ``echo`` with ``logprobs`` (a number for completions, true for chat)."""
    logprobs = body.get("logprobs")
    return body.get("prompt_logprobs") is not None or (
        body.get("echo") is True and logprobs is not None and logprobs is not False)


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: not streamed (the router reads one JSON answer), no stream
    options, and the request to keep the KV for a decode instance."""
    prefill = {name: value for name, value in body.items() if name != "stream_options"}
    prefill["stream"] = False
    prefill[KV_TRANSFER_PARAMS] = dict(REMOTE_DECODE)
    return prefill


def _kv_transfer_params(answer: bytes) -> dict[str, Any] | None:
    try:
        parsed = json.loads(answer)
    except ValueError:
        return None
    params = parsed.get(KV_TRANSFER_PARAMS) if isinstance(parsed, dict) else None
    return params if isinstance(params, dict) else None


def _without_kv_transfer(body: bytes, parsed: dict[str, Any]) -> bytes:
    """The client's own bytes, unless it sent ``kv_transfer_params`` itself: those are the
    router's to give, so a body without them."""
    if KV_TRANSFER_PARAMS not in parsed:
        return body
    return _encode({name: value for name, value in parsed.items() if name != KV_TRANSFER_PARAMS})


def _encode(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()
