"""``Endpoint``: a remote ``kvloom serve`` as a kvloom.lang backend, with the same
semantics as ``Local``: the text is tokenized by the server (``POST /tokenize``,
without special tokens, as ``Local`` does) and generated from those token ids
(``/v1/completions``), choices are scored by ``POST /kvloom/score`` and the chat
roles come from ``GET /kvloom/chat_roles``. Thread-safe: the states' threads share
one HTTP client, so the server batches them."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import httpx

from kvloom.lang.backend import Generated, Scored
from kvloom.sampling_params import SamplingParams


class Endpoint:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout,
                                   limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self._roles: dict[str, tuple[str, str]] | None = None
        self._lock = threading.Lock()

    def role_markers(self, role: str) -> tuple[str, str]:
        with self._lock:
            if self._roles is None:
                roles = self._call("GET", "/kvloom/chat_roles")
                self._roles = {name: (pair[0], pair[1]) for name, pair in roles.items()}
        return self._roles[role]

    def generate(self, text: str, params: SamplingParams,
                 on_text: Callable[[str], None] | None = None) -> Generated:
        token_ids = self._call("POST", "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
        body: dict[str, Any] = {"prompt": token_ids, "max_tokens": params.max_tokens,
                                "temperature": params.temperature, "stop": params.stop or None}
        structured = params.structured
        if structured is not None and structured.regex is not None:
            body["guided_regex"] = structured.regex
        elif structured is not None and structured.json_schema is not None:
            body["guided_json"] = structured.json_schema
        if on_text is None:
            answer = self._call("POST", "/v1/completions", body)
            output, usage = answer["choices"][0]["text"], answer["usage"]
        else:
            output, usage = self._stream(body, on_text)
        return Generated(output, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"])

    def _stream(self, body: dict[str, Any], on_text: Callable[[str], None]) -> tuple[str, dict[str, Any]]:
        """A streamed completion: each event's text to ``on_text``; the usage comes last."""
        pieces: list[str] = []
        usage: dict[str, Any] = {}
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with self.client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                if response.status_code == 400:
                    raise ValueError(_message(response))
                raise RuntimeError(f"POST /v1/completions answered {response.status_code}: {_message(response)}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"the server failed mid-stream: {event['error'].get('message')}")
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        pieces.append(choice["text"])
                        on_text(choice["text"])
                usage = event.get("usage") or usage
        return "".join(pieces), usage

    def score(self, text: str, choices: list[str]) -> Scored:
        answer = self._call("POST", "/kvloom/score", {"prompt": text, "choices": choices})
        return Scored(list(answer["logprobs"]), list(answer["cached_tokens"]))

    def close(self) -> None:
        self.client.close()

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self.client.request(method, path, json=body)
        if response.status_code == 400:  # the request's own fault: a constraint that cannot compile, ...
            raise ValueError(_message(response))
        if response.status_code != 200:
            raise RuntimeError(f"{method} {path} answered {response.status_code}: {_message(response)}")
        return response.json()


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text
