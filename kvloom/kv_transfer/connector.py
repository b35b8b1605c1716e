"""The KV connector: what the scheduler asks of prefill/decode disaggregation, one
object per engine, by ``--role``.

- ``KVTransfer`` (``--role both``): the null connector; nothing moves.
- ``PrefillTransfer`` (``--role prefill``): a request marked ``KVExport`` is admitted
  only once the staging area has room for its prompt (``reserve``: the back-pressure);
  when its prompt is computed, ``export`` copies its blocks out (staging.py) and the
  engine hands the ``StagedKV`` back with the request's output.
- ``DecodeTransfer`` (``--role decode``): a request marked ``KVImport`` is admitted
  like a prefix hit: the scheduler allocates its blocks, ``start_import`` queues the
  pull of the blocks past the local prefix onto a transfer thread, and the request
  waits (status RECEIVING) while the engine keeps stepping the others; ``poll``
  returns finished pulls at the start of each step. A pull that fails leaves the
  request to compute the rest of its prompt here: nothing is lost, and a block
  is never freed while the thread may still write it.

The scheduler is still the one writer of request state: the connector reports, the
scheduler advances ``num_computed_tokens``.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from kvloom.attention.base import AttentionBackend
from kvloom.config import EngineConfig, ModelConfig
from kvloom.kv_spec import KVExport, KVImport, KVLayout, KVTransferSpec, StagedKV, token_hash
from kvloom.kv_transfer.staging import KVStaging, StagingStats
from kvloom.kv_transfer.transport import (
    TRANSPORTS,
    KVServer,
    KVTransport,
    SharedMemoryTransport,
    TorchTransport,
    TransferFailed,
)
from kvloom.native import release_openmp_team
from kvloom.request import Request

logger = logging.getLogger(__name__)


def layout_of(model_name: str, model_config: ModelConfig, pool: torch.Tensor,
              backend: AttentionBackend[Any]) -> KVLayout:
    """This engine's ``KVLayout``, from its model and KV pool
    ``[layers, planes, blocks, block_size, kv_heads, head_dim]``."""
    paired = getattr(backend, "paired_layout", None)
    # one layer's cache (a pure state-space model's pool has no layers)
    order = "paired" if paired is not None and pool.shape[0] and paired(pool[0]) else "token-major"
    return KVLayout(model_name, hashlib.sha256(repr(model_config).encode()).hexdigest()[:16],
                    str(pool.dtype).removeprefix("torch."), pool.shape[3], pool.shape[0], pool.shape[4],
                    pool.shape[5], f"{backend.name}/{order}", pool.shape[1])


@dataclass(frozen=True)
class ImportResult:
    """A finished pull: ``num_tokens`` tokens' KV arrived (counted as computed), 0 when it
    failed (``error`` says why)."""

    request: Request
    num_tokens: int
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None


@dataclass
class ImportStats:
    imports: int = 0  # pulls that delivered
    failures: int = 0  # pulls that failed (those requests computed their prompts here)
    bytes: int = 0
    seconds: float = 0.0  # on the transfer thread, summed


@dataclass(frozen=True)
class _Job:
    request: Request | None  # None: only telling the prefill side it may drop the entry
    staged: StagedKV
    first_block: int
    num_blocks: int
    block_ids: list[int]
    num_tokens: int
    last: bool


class KVTransfer:
    """``--role both``: the null connector."""

    role = "both"

    def __init__(self, layout: KVLayout | None = None, instance_id: str = "") -> None:
        self.layout = layout
        self.instance_id = instance_id
        self.imports = ImportStats()
        self.staging_stats = StagingStats()

    def refuse(self, spec: KVTransferSpec | None) -> str | None:
        """Why this instance cannot take a request with ``spec``; None if it can."""
        if spec is None:
            return None
        wanted = "prefill" if isinstance(spec, KVExport) else "decode"
        return (f"this instance serves --role {self.role}; a request that "
                f"{'stages its KV' if wanted == 'prefill' else 'brings staged KV'} needs --role {wanted}")

    def reserve(self, request: Request) -> bool:
        return True

    def export(self, request: Request) -> None:
        return None

    def finish(self, request: Request) -> None:
        return None

    def take_staged(self, request_id: str) -> StagedKV | None:
        return None

    def accept(self, spec: KVTransferSpec | None, token_ids: list[int], request_id: str,
               adapter: str | None = None) -> KVTransferSpec | None:
        """The spec a new request keeps: None where staged KV cannot serve it here
        (``adapter``: the LoRA adapter the request runs)."""
        return spec

    def importable(self, request: Request, first_token: int) -> int:
        """The prompt tokens a pull would deliver past a local prefix of ``first_token``
        (no side effects: asked again while the request waits for blocks)."""
        return 0

    def skip_import(self, request: Request) -> None:
        """The request was admitted without pulling (its prefix is cached here)."""
        return None

    def start_import(self, request: Request, first_token: int, num_tokens: int) -> None:
        raise AssertionError("only a decode instance imports KV")

    def poll(self) -> list[ImportResult]:
        return []

    def wait(self, timeout: float) -> None:
        return None

    def info(self) -> dict[str, Any]:
        return {"role": self.role, "instance_id": self.instance_id,
                "layout": self.layout.as_dict() if self.layout else None,
                "transports": [], "kv_endpoint": None}

    def check_integrity(self) -> None:
        return None

    def close(self) -> None:
        return None


class PrefillTransfer(KVTransfer):
    role = "prefill"

    def __init__(self, layout: KVLayout, instance_id: str, staging: KVStaging, server: KVServer | None) -> None:
        super().__init__(layout, instance_id)
        self.staging = staging
        self.server = server
        self.staging_stats = staging.stats

    def refuse(self, spec: KVTransferSpec | None) -> str | None:
        return super().refuse(spec) if isinstance(spec, KVImport) else None

    def reserve(self, request: Request) -> bool:
        if not isinstance(request.kv_transfer, KVExport):
            return True
        return self.staging.reserve(request.request_id, request.num_prompt_tokens)

    def export(self, request: Request) -> None:
        """The prompt is computed: stage its blocks (raises StagingError)."""
        num_blocks = -(-request.num_prompt_tokens // self.staging.layout.block_size)
        self.staging.stage(request.request_id, request.prompt_token_ids, request.block_ids[:num_blocks],
                           request.adapter_name)

    def finish(self, request: Request) -> None:
        self.staging.release(request.request_id)

    def take_staged(self, request_id: str) -> StagedKV | None:
        return self.staging.take_staged(request_id)

    def poll(self) -> list[ImportResult]:
        self.staging.sweep()
        return []

    def info(self) -> dict[str, Any]:
        return {**super().info(), "transports": list(TRANSPORTS) if self.server else ["shm"],
                "kv_endpoint": self.server.endpoint if self.server else None}

    def check_integrity(self) -> None:
        self.staging.check_integrity()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.staging.close()


class DecodeTransfer(KVTransfer):
    role = "decode"

    def __init__(self, layout: KVLayout, instance_id: str, pool: torch.Tensor, transport: KVTransport) -> None:
        super().__init__(layout, instance_id)
        self.pool = pool
        self.transport = transport
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._done: list[ImportResult] = []
        self._lock = threading.Lock()
        self._arrived = threading.Event()
        self._pulls: dict[str, int] = {}  # staged key -> requests here that pulled it so far
        self._claimed: set[str] = set()  # requests whose pull is counted (until they finish)
        self._in_flight = 0
        self._thread = threading.Thread(target=self._run, name="kv-import", daemon=True)
        self._thread.start()

    def refuse(self, spec: KVTransferSpec | None) -> str | None:
        return super().refuse(spec) if isinstance(spec, KVExport) else None

    def accept(self, spec: KVTransferSpec | None, token_ids: list[int], request_id: str,
               adapter: str | None = None) -> KVTransferSpec | None:
        """Staged KV of another layout, of other tokens or of another LoRA adapter
        (``adapter``: the request's) is refused here (once, when the request arrives):
        the request then computes its prompt itself."""
        if not isinstance(spec, KVImport):
            return spec
        staged = spec.staged
        assert self.layout is not None
        problem = self.layout.mismatch(staged.layout)
        if problem is None and (staged.num_tokens != len(token_ids) or staged.token_hash != token_hash(token_ids)):
            problem = f"it holds {staged.num_tokens} tokens that are not this request's {len(token_ids)} prompt tokens"
        if problem is None and staged.adapter != adapter:
            problem = (f"it was computed with {_model_of(staged.adapter)}, and this request runs "
                       f"{_model_of(adapter)}")
        if problem is None:
            problem = self.transport.refusal(staged)
        if problem is None:
            return spec
        self.imports.failures += 1
        logger.warning("request %s: staged KV %s refused (%s); computing its prompt here", request_id,
                       staged.key, problem)
        return None

    def importable(self, request: Request, first_token: int) -> int:
        if (not isinstance(request.kv_transfer, KVImport) or request.num_preemptions
                or request.sampling_params.prompt_logprobs is not None):
            return 0  # a preempted request recomputes here (its imported blocks stay cached)
        # The last prompt token is computed here (its logits are needed), as after a hit.
        return max(0, request.num_prompt_tokens - 1 - first_token)

    def start_import(self, request: Request, first_token: int, num_tokens: int) -> None:
        """Pull the prompt's KV for tokens ``[first_token, first_token + num_tokens)`` into
        the request's blocks (``first_token`` is block-aligned: a prefix-cache hit)."""
        spec = request.kv_transfer
        assert isinstance(spec, KVImport) and self.layout is not None
        block_size = self.layout.block_size
        first_block = first_token // block_size
        num_blocks = -(-(first_token + num_tokens) // block_size) - first_block
        self._queue(_Job(request, spec.staged, first_block, num_blocks,
                         list(request.block_ids[first_block:first_block + num_blocks]),
                         first_token + num_tokens, bool(self._claim(request))))

    def skip_import(self, request: Request) -> None:
        self._release_pull(request)

    def finish(self, request: Request) -> None:
        self._release_pull(request)  # one that never pulled still counts
        self._claimed.discard(request.request_id)

    def _release_pull(self, request: Request) -> None:
        if self._claim(request):
            spec = request.kv_transfer
            assert isinstance(spec, KVImport)
            self._queue(_Job(None, spec.staged, 0, 0, [], 0, True))

    def _claim(self, request: Request) -> bool | None:
        """Count the request's one pull of its staged KV (None: already counted); True
        when it is the last of the ``pulls`` this instance will make of it."""
        spec = request.kv_transfer
        if not isinstance(spec, KVImport) or request.request_id in self._claimed:
            return None
        self._claimed.add(request.request_id)
        key = spec.staged.key
        pulled = self._pulls.get(key, 0) + 1
        if pulled >= spec.pulls:
            self._pulls.pop(key, None)
            return True
        self._pulls[key] = pulled
        return False

    def _queue(self, job: _Job) -> None:
        if job.request is not None:
            with self._lock:
                self._in_flight += 1
        self._jobs.put(job)

    def poll(self) -> list[ImportResult]:
        with self._lock:
            done, self._done = self._done, []
            self._in_flight -= len(done)
            if not self._in_flight:
                self._arrived.clear()
        for result in done:
            if result.error is None:
                self.imports.imports += 1
                self.imports.bytes += result.nbytes
            else:
                self.imports.failures += 1
            self.imports.seconds += result.seconds
        return done

    def wait(self, timeout: float) -> None:
        """Until a pull finishes (or ``timeout``): an engine with nothing else to run."""
        self._arrived.wait(timeout)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "transports": [self.transport.name]}

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5.0)
        self.transport.close()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            started = time.perf_counter()
            try:
                try:
                    nbytes = self.transport.pull(job.staged, job.first_block, job.num_blocks, self.pool,
                                                 job.block_ids, job.last)
                finally:
                    # The pull's copy into the pool ran parallel regions on this thread; its
                    # OpenMP team must not outlive it, or libgomp (then managing more threads
                    # than there are cores) throttles every step of the engine's own team.
                    release_openmp_team()
                if job.request is None:
                    continue
                result = ImportResult(job.request, job.num_tokens, nbytes, time.perf_counter() - started)
            except Exception as error:  # noqa: BLE001 - the request computes its prompt here instead
                if job.request is None:
                    logger.info("releasing staged KV %s failed: %s", job.staged.key, error)
                    continue
                if not isinstance(error, TransferFailed):
                    logger.exception("pulling staged KV %s failed", job.staged.key)
                else:
                    logger.warning("request %s: %s; computing its prompt here", job.request.request_id, error)
                result = ImportResult(job.request, 0, 0, time.perf_counter() - started, str(error))
            with self._lock:
                self._done.append(result)
                self._arrived.set()


def make_kv_transfer(config: EngineConfig, layout: KVLayout, pool: torch.Tensor) -> KVTransfer:
    """The connector for ``config.kv_transfer.role``."""
    settings = config.kv_transfer
    instance_id = uuid.uuid4().hex[:12]
    if settings.role == "prefill":
        staging = KVStaging(layout, pool, int(settings.kv_buffer_gib * (1 << 30)), settings.kv_transfer_timeout,
                            instance_id, None, settings.kv_shm_dir)
        server = KVServer(staging, layout, instance_id, settings.kv_host, settings.kv_port,
                          settings.kv_transfer_timeout)
        staging.endpoint = server.endpoint
        logger.info("prefill instance %s: staging up to %.1f GiB of KV in %s, torch.distributed KV server "
                    "on %s", instance_id, settings.kv_buffer_gib, settings.kv_shm_dir, server.endpoint)
        return PrefillTransfer(layout, instance_id, staging, server)
    if settings.role == "decode":
        transport: KVTransport = (TorchTransport(layout, settings.kv_transfer_timeout)
                                  if settings.kv_transport == "torch" else SharedMemoryTransport(settings.kv_shm_dir))
        logger.info("decode instance %s: pulling KV over %s", instance_id, transport.name)
        return DecodeTransfer(layout, instance_id, pool, transport)
    return KVTransfer(layout, instance_id)


def _model_of(adapter: str | None) -> str:
    return "the base model" if adapter is None else f"LoRA adapter {adapter!r}"
