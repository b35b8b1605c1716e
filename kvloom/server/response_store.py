"""Stored responses for the Responses API (vLLM's, behind ``VLLM_ENABLE_RESPONSES_API_STORE``;
here ``--enable-responses-store``): a finished response with ``store`` (true by default, as
OpenAI's) is kept with its conversation, so that ``GET /v1/responses/{id}`` returns it and
a request naming it as ``previous_response_id`` continues from it. In memory, the
``capacity`` most recently stored kept (an older one is then a 404, as a deleted one).
A response created with ``background`` and ``stream`` also keeps its stream's events
(``EventLog``), so that a client can read them again from any point, while it runs and
after (``GET /v1/responses/{id}?stream=true&starting_after=N``): those of the
``log_capacity`` most recently ended, and of every one still running."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 10_000
# Ended streams whose events are kept. A stream's events hold its text a few times over
# (deltas, then the done events), so fewer than the responses themselves.
DEFAULT_LOG_CAPACITY = 256


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as it was answered
    # The input items it answered (a previous response's conversation first, without
    # instructions, which do not carry over) and then its output items: what a request
    # that continues from it puts before its own input.
    conversation: list[dict[str, Any]]


class EventLog:
    """One stream's events (SSE text), in order: event i has ``sequence_number`` i. Written
    by one task (the response's generation); read by any number of ``follow``ers, each
    from where it asks, until the log has ended."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.ended = False
        self._changed = asyncio.Event()  # set, and replaced, at each change

    def append(self, event: str) -> None:
        assert not self.ended, "an ended log takes no more events"
        self.events.append(event)
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, start: int = 0) -> AsyncIterator[str]:
        """The events from index ``start`` on, as they come, until the log ends. A reader
        that goes away stops only itself (the generation goes on)."""
        index = start
        while True:
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.ended:
                return
            await self._changed.wait()  # no await between the checks and here: no event is missed


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, log_capacity: int = DEFAULT_LOG_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if log_capacity < 1:
            raise ValueError(f"log_capacity must be >= 1, got {log_capacity}")
        self.capacity, self.log_capacity = capacity, log_capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        # Background responses still running (``background: true``): their tasks, which
        # ``cancel`` stops; each removes itself when it ends (``ended``).
        self.running: dict[str, asyncio.Task[None]] = {}
        # Running ones deleted: cancelled, and what their tasks still store is dropped.
        self._deleted: set[str] = set()
        # Streamed background responses' events, oldest first: every running one's, and
        # the ``log_capacity`` most recently created of those that have ended.
        self._logs: OrderedDict[str, EventLog] = OrderedDict()

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        if response["id"] in self._deleted:
            return
        self._responses[response["id"]] = StoredResponse(response, [*input_items, *response["output"]])
        self._responses.move_to_end(response["id"])
        while len(self._responses) > self.capacity:
            evicted, _ = self._responses.popitem(last=False)
            self._drop_log(evicted)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        """Forgets ``response_id``; a background one still running is stopped (its task
        cancelled) and not stored again."""
        task = self.running.get(response_id)
        if task is not None:
            self._deleted.add(response_id)
            task.cancel()
        self._drop_log(response_id)
        return self._responses.pop(response_id, None) is not None

    def ended(self, response_id: str) -> None:
        """A background response's task has ended (its log, if any, too): one deleted
        while it ran leaves nothing behind."""
        self.running.pop(response_id, None)
        if response_id in self._deleted:
            self._deleted.discard(response_id)
            self._drop_log(response_id)

    def new_log(self, response_id: str) -> EventLog:
        """A log for ``response_id``'s events; the oldest ended logs beyond
        ``log_capacity`` are forgotten (a running one never is: its readers follow it)."""
        log = self._logs[response_id] = EventLog()
        excess = len(self._logs) - self.log_capacity
        for old in [rid for rid, kept in self._logs.items() if kept.ended][:max(0, excess)]:
            del self._logs[old]
        return log

    def log(self, response_id: str) -> EventLog | None:
        return self._logs.get(response_id)

    def _drop_log(self, response_id: str) -> None:
        log = self._logs.get(response_id)
        if log is not None and log.ended:  # a running one's readers still follow it
            del self._logs[response_id]

    def __len__(self) -> int:
        return len(self._responses)
