"""Requests about a stored response go to the worker that stored it.

A worker started with ``--enable-responses-store`` keeps the responses it answered in its
own memory (kvloom/server/response_store.py). Behind the router, ``GET`` and ``DELETE
/v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` and a ``POST /v1/responses``
that continues from a ``previous_response_id`` must therefore reach that worker; any
other would answer 404. The router keeps no map of ids: it asks the workers that are up
(``GET /v1/responses/{id}``, all at once, with its ``--api-key``) and the one that answers 200 is the owner. So
a restarted router still finds every response, and a response deleted, evicted or lost
with its worker is found nowhere: the request then goes where it would have gone, and
that worker's own 404 names the id. A continuation is stored by the owner too, so a
chain of responses stays on one worker, whose prefix cache holds its conversation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from urllib.parse import quote

import httpx

from kvloom.router.policy import Decision, WorkerLoad
from kvloom.router.proxy import Chooser
from kvloom.router.workers import WorkerPool

STORED_RESPONSE = "stored_response"  # the routing decision's reason (a metric label)


class StoredResponses:
    def __init__(self, pool: WorkerPool, client: httpx.AsyncClient, headers: dict[str, str],
                 timeout: float) -> None:
        self.pool = pool
        self.client = client
        self.headers = headers  # the router's own calls' (RouterConfig.worker_headers)
        self.timeout = timeout

    async def owner(self, response_id: str, among: Collection[str] | None = None) -> str | None:
        """The up worker (of ``among``, when given) that holds ``response_id``; None when
        none does, or none answered in time. Ids are random (``resp_`` and a UUID), so
        at most one worker holds one."""
        urls = [w.url for w in self.pool.up() if among is None or w.url in among]
        path = f"/v1/responses/{quote(response_id, safe='')}"
        held = await asyncio.gather(*(self._holds(url + path) for url in urls))
        return next((url for url, holds in zip(urls, held, strict=True) if holds), None)

    async def _holds(self, url: str) -> bool:
        try:
            response = await self.client.get(url, headers=self.headers, timeout=self.timeout)
        except httpx.HTTPError:
            return False  # the health check decides whether that worker is down
        return response.status_code == 200


def to_owner(owner: str | None, otherwise: Chooser) -> Chooser:
    """Chooses ``owner`` while it is a candidate (up, not given up on); otherwise (no
    owner, or it failed before answering) what ``otherwise`` chooses."""
    def choose(candidates: Sequence[WorkerLoad]) -> Decision:
        if owner is not None and any(c.worker == owner for c in candidates):
            return Decision(owner, STORED_RESPONSE)
        return otherwise(candidates)
    return choose
