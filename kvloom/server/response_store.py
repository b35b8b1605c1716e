"""Stored responses for the Responses API (vLLM's, behind ``VLLM_ENABLE_RESPONSES_API_STORE``;
here ``--enable-responses-store``): a finished response with ``store`` (true by default, as
OpenAI's) is kept with its conversation, so that ``GET /v1/responses/{id}`` returns it and
a request naming it as ``previous_response_id`` continues from it. In memory, the
``capacity`` most recently stored kept (an older one is then a 404, as a deleted one)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 10_000


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as it was answered
    # The input items it answered (a previous response's conversation first, without
    # instructions, which do not carry over) and then its output items: what a request
    # that continues from it puts before its own input.
    conversation: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        # Background responses still running (``background: true``): their tasks, which
        # ``cancel`` stops; each removes itself when it ends.
        self.running: dict[str, asyncio.Task[None]] = {}

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        self._responses[response["id"]] = StoredResponse(response, [*input_items, *response["output"]])
        self._responses.move_to_end(response["id"])
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._responses)
