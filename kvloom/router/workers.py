"""The workers behind the router: health, in-flight counts, and the startup checks.

A worker is *up* or *down*. The router sends requests only to workers that are up. A
worker goes down when a connection to it is refused (at once: nothing listens there),
or after ``health_failures`` consecutive failed health checks (a slow answer under load
is not a death); it comes back up at its first good check, with nothing remembered in
the routing policy (its cache may be gone). ``in_flight`` counts the requests this
router has open on the worker, from dispatch to the end of the response: it is the
load the policies balance. A disaggregated router's startup check also asks every
instance for its role and KV layout (``GET /kvloom/kv_transfer``): the pools must hold
what they were told, and every layout must be the first prefill instance's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar, cast

import httpx

from kvloom.router.config import RouterConfig
from kvloom.router.metrics import RouterMetrics
from kvloom.router.policy import WorkerLoad

logger = logging.getLogger(__name__)
T = TypeVar("T")


class RouterStartupError(ValueError):
    """The router cannot start: the message names the worker(s) and the problem."""


@dataclass(frozen=True)
class WorkerInfo:
    """What must agree between workers: the model id clients use, its context, and the
    KV block size (``None`` from a worker that does not report it). ``role``: a
    disaggregated router's instances' (prefill or decode), else None."""

    model: str
    max_model_len: int | None
    block_size: int | None
    role: str | None = None


@dataclass(frozen=True)
class KVTransferInfo:
    """An instance's ``GET /kvloom/kv_transfer``: its role, and the KV layout (model,
    dtype, block size, layers, heads, cache layout) that prefill and decode instances
    must share for one's KV to be the other's."""

    role: str
    layout: dict[str, Any]
    instance_id: str | None = None
    transports: tuple[str, ...] = ()
    kv_endpoint: str | None = None


@dataclass(slots=True)
class Worker:
    url: str
    up: bool = True
    in_flight: int = 0
    failed_checks: int = 0


class WorkerPool:
    """The workers, by URL, in the configured order."""

    def __init__(self, config: RouterConfig, client: httpx.AsyncClient, metrics: RouterMetrics,
                 on_down: Callable[[str], None]) -> None:
        self.config = config
        self.client = client
        self.metrics = metrics
        self.on_down = on_down
        self.workers = {url: Worker(url) for url in config.workers}
        self._probes: set[asyncio.Task[None]] = set()
        for url in self.workers:
            metrics.worker_up.labels(url).set(1)
            metrics.in_flight.labels(url).set(0)

    # ---- state ---------------------------------------------------------------------------
    def up(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.up]

    def loads(self, exclude: Mapping[str, int] | None = None, limit: int = 1,
              among: Collection[str] | None = None) -> list[WorkerLoad]:
        """The up workers' loads (only those ``among``, when given: one pool), without those
        tried ``limit`` times already."""
        tried = exclude or {}
        return [WorkerLoad(w.url, w.in_flight) for w in self.up()
                if tried.get(w.url, 0) < limit and (among is None or w.url in among)]

    def acquire(self, url: str) -> None:
        self.workers[url].in_flight += 1
        self.metrics.in_flight.labels(url).inc()

    def release(self, url: str) -> None:
        worker = self.workers[url]
        assert worker.in_flight > 0, f"in-flight count of {url} would go negative"
        worker.in_flight -= 1
        self.metrics.in_flight.labels(url).dec()

    def mark_down(self, url: str, reason: str) -> None:
        worker = self.workers[url]
        if worker.up:
            logger.warning("worker %s is down: %s", url, reason)
            worker.up = False
            self.metrics.worker_up.labels(url).set(0)
            self.on_down(url)

    def mark_up(self, url: str) -> None:
        worker = self.workers[url]
        worker.failed_checks = 0
        if not worker.up:
            logger.info("worker %s is up again", url)
            worker.up = True
            self.metrics.worker_up.labels(url).set(1)

    # ---- health --------------------------------------------------------------------------
    async def check(self, url: str) -> None:
        """One health check of ``url``: up on 200, down on a refused connection or after
        ``health_failures`` failures in a row."""
        try:
            response = await self.client.get(f"{url}/health", timeout=self.config.health_timeout)
            healthy, reason = response.status_code == 200, f"/health answered {response.status_code}"
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            self.mark_down(url, f"connection failed ({error!r})")
            return
        except httpx.HTTPError as error:
            healthy, reason = False, f"/health failed ({error!r})"
        if healthy:
            self.mark_up(url)
            return
        worker = self.workers[url]
        worker.failed_checks += 1
        if worker.failed_checks >= self.config.health_failures:
            self.mark_down(url, reason)

    def probe_soon(self, url: str) -> None:
        """Check ``url`` now, in the background (after a request to it failed oddly)."""
        task = asyncio.get_running_loop().create_task(self.check(url))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def health_loop(self) -> None:
        """Check every worker each ``health_interval`` seconds, until cancelled."""
        while True:
            await asyncio.gather(*(self.check(url) for url in self.workers))
            await asyncio.sleep(self.config.health_interval)


# ---- the startup check -------------------------------------------------------------------
async def fetch_worker_info(client: httpx.AsyncClient, url: str, deadline: float,
                            headers: Mapping[str, str]) -> WorkerInfo:
    """``url``'s ``GET /v1/models``, polled until it answers 200 (a loading worker answers
    503) or ``deadline`` (the loop's clock) passes: then RouterStartupError."""
    loop = asyncio.get_running_loop()
    last = "no answer"
    while True:
        try:
            response = await client.get(f"{url}/v1/models", headers=dict(headers), timeout=5.0)
            if response.status_code == 200:
                return _parse_models(url, response.json())
            if response.status_code == 401:
                raise RouterStartupError(f"worker {url} requires an API key: give the router the "
                                         "same --api-key")
            if response.status_code != 503:
                raise RouterStartupError(f"worker {url} answered GET /v1/models with "
                                         f"{response.status_code}: is it a kvloom server?")
            last = "503 (still loading)"
        except httpx.HTTPError as error:
            last = repr(error)
        except ValueError as error:  # not JSON, or not the shape of /v1/models
            if isinstance(error, RouterStartupError):
                raise
            raise RouterStartupError(f"worker {url}: GET /v1/models is not a model list ({error})") from None
        if loop.time() >= deadline:
            raise RouterStartupError(f"worker {url} did not answer GET /v1/models before the startup "
                                     f"deadline (last: {last}); is it running?")
        await asyncio.sleep(min(0.1, max(0.0, deadline - loop.time())))


def _parse_models(url: str, body: Any) -> WorkerInfo:
    try:
        entry = body["data"][0]
        return WorkerInfo(str(entry["id"]), entry.get("max_model_len"), entry.get("block_size"))
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"unexpected body {str(body)[:200]!r}") from None


def check_consistent(infos: Mapping[str, WorkerInfo]) -> None:
    """RouterStartupError naming the first two workers that disagree and the values."""
    (first_url, first), *rest = infos.items()
    for url, info in rest:
        for what in ("model", "block_size", "max_model_len"):
            mine, theirs = getattr(first, what), getattr(info, what)
            if what != "model" and (mine is None or theirs is None):
                continue  # not reported: nothing to compare
            if mine != theirs:
                raise RouterStartupError(
                    f"workers disagree on the {what.replace('_', ' ')}: {first_url} has {mine!r}, "
                    f"{url} has {theirs!r}; every worker must serve the same model with the same "
                    "engine flags")


async def check_workers(config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None
                        ) -> dict[str, WorkerInfo]:
    """Every worker's ``/v1/models``, concurrently, within ``startup_timeout``; then the
    consistency check; for a disaggregated router, then every instance's role and KV
    layout (``check_kv_transfer``). RouterStartupError on the first problem."""
    headers = config.worker_headers
    async with httpx.AsyncClient(transport=transport) as client:
        deadline = asyncio.get_running_loop().time() + config.startup_timeout
        infos = await _gather(config.workers, (fetch_worker_info(client, url, deadline, headers)
                                               for url in config.workers))
        check_consistent(infos)
        if not config.disaggregated:
            return infos
        kv = await _gather(config.workers, (fetch_kv_transfer_info(client, url, headers)
                                            for url in config.workers))
    check_kv_transfer(config, kv)
    return {url: replace(info, role=kv[url].role) for url, info in infos.items()}


async def _gather(urls: Sequence[str], calls: Iterable[Awaitable[T]]) -> dict[str, T]:
    """The calls' results by URL, concurrently; the first URL's error (in order) raised."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return dict(zip(urls, cast("list[T]", results), strict=True))


# ---- the disaggregated startup check ------------------------------------------------------
KV_TRANSFER_PATH = "/kvloom/kv_transfer"


async def fetch_kv_transfer_info(client: httpx.AsyncClient, url: str, headers: Mapping[str, str]
                                 ) -> KVTransferInfo:
    """``url``'s ``GET /kvloom/kv_transfer`` (it answered ``/v1/models`` already, so once)."""
    what = f"GET {KV_TRANSFER_PATH}"
    try:
        response = await client.get(f"{url}{KV_TRANSFER_PATH}", headers=dict(headers), timeout=5.0)
    except httpx.HTTPError as error:
        raise RouterStartupError(f"instance {url}: {what} failed ({error!r})") from None
    if response.status_code == 401:
        raise RouterStartupError(f"instance {url} requires an API key: give the router the same --api-key")
    if response.status_code != 200:
        raise RouterStartupError(f"instance {url} answered {what} with {response.status_code}: only kvloom "
                                 "servers started with --role prefill or --role decode take part in "
                                 "prefill/decode disaggregation")
    try:
        body = response.json()
        role, layout = body["role"], body["layout"]
        if not isinstance(role, str) or not isinstance(layout, dict):
            raise TypeError
        return KVTransferInfo(role, layout, body.get("instance_id"), tuple(body.get("transports") or ()),
                              body.get("kv_endpoint"))
    except (ValueError, KeyError, TypeError):
        raise RouterStartupError(f"instance {url}: {what} is not a KV transfer description "
                                 f"({response.text[:200]!r})") from None


def check_kv_transfer(config: RouterConfig, infos: Mapping[str, KVTransferInfo]) -> None:
    """Every ``--prefill`` instance has role prefill, every ``--decode`` one decode, and
    all have the first prefill instance's KV layout; else RouterStartupError naming the
    instance, and for a layout the field, both values and both instances."""
    pools = {**{url: "prefill" for url in config.prefill}, **{url: "decode" for url in config.decode}}
    for url, pool in pools.items():
        if infos[url].role != pool:
            raise RouterStartupError(f"{pool} {url} reports role {infos[url].role!r} (GET {KV_TRANSFER_PATH}), "
                                     f"not {pool!r}: start it with `kvloom serve --role {pool}`")
    first = config.prefill[0]
    reference = infos[first].layout
    for url in config.workers:
        layout = infos[url].layout
        for name in (*reference, *(k for k in layout if k not in reference)):
            if layout.get(name) != reference.get(name):
                raise RouterStartupError(
                    f"{pools[url]} {url} has {name} {layout.get(name)!r} but prefill {first} has "
                    f"{reference.get(name)!r}: instances of a different model, dtype, block size or "
                    "cache layout cannot share KV")
