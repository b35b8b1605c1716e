"""The prefill side's staging area: prompts' KV blocks, copied out of the pool, waiting
for a decode instance to pull them.

Each staged prompt is one file in shared memory (``/dev/shm``) holding its blocks as
``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``: the pool's own layout,
only the request's blocks. A decode instance on this host maps the file; one on
another host pulls the same bytes through the torch.distributed server
(transport.py). Copying out at once lets the request's blocks return to the pool and
the prefix cache at the end of its step, so staging never holds pool blocks.

Back-pressure: the area has a byte budget. A request is admitted only once room for
its prompt is reserved (``reserve``), so a decode instance that pulls slowly (out of
blocks) makes new prefills wait here instead of being computed and dropped. An entry
leaves when its last puller says so (``drop``; a shared-memory puller may instead
remove the file, which ``sweep`` notices) or at its deadline (a decode instance that
never came). Invariant (``check_integrity``): reserved + staged bytes <= budget, and
every staged entry's file exists until the entry is dropped.

Thread safety: the engine thread reserves, stages and sweeps; the torch server's
threads read and drop. One lock covers the tables.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass

import torch

from kvloom.kv_spec import KVLayout, StagedKV, token_hash

logger = logging.getLogger(__name__)


class StagingError(RuntimeError):
    """Staging a prompt's KV failed (no room in shared memory, ...): that request fails."""


@dataclass
class _Entry:
    staged: StagedKV
    nbytes: int
    deadline: float
    data: torch.Tensor  # the file's pages, mapped


@dataclass
class StagingStats:
    staged: int = 0  # prompts staged
    staged_bytes: int = 0
    pulled: int = 0  # entries dropped by their last puller
    expired: int = 0  # entries dropped at their deadline, never (fully) pulled
    stage_seconds: float = 0.0  # copying out of the pool


class KVStaging:
    def __init__(self, layout: KVLayout, pool: torch.Tensor, budget_bytes: int, timeout_s: float,
                 instance_id: str, endpoint: str | None, directory: str = "/dev/shm") -> None:
        self.layout = layout
        self.pool = pool
        self.budget_bytes = budget_bytes
        self.timeout_s = timeout_s
        self.instance_id = instance_id
        self.endpoint = endpoint
        self.directory = directory
        self.stats = StagingStats()
        self._reserved: dict[str, int] = {}  # request id -> bytes
        self._entries: dict[int, _Entry] = {}  # staged index -> entry
        self._by_request: dict[str, StagedKV] = {}  # staged, until the engine reports it
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        remove_orphans(directory)

    # ---- the engine thread -------------------------------------------------------------
    def nbytes_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.layout.block_size) * self.layout.bytes_per_block

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        """Room for a prompt of ``num_tokens``: True once reserved (again: True). A prompt
        larger than the whole budget is let through alone, or it would never run."""
        with self._lock:
            if request_id in self._reserved:
                return True
            need = self.nbytes_for(num_tokens)
            used = self._used_bytes()
            if used + need > self.budget_bytes and used > 0:
                return False
            self._reserved[request_id] = need
            return True

    def release(self, request_id: str) -> None:
        """The request ended: its reservation (if never staged) goes back."""
        with self._lock:
            self._reserved.pop(request_id, None)

    def stage(self, request_id: str, token_ids: list[int], block_ids: list[int],
              adapter: str | None = None) -> StagedKV:
        """Copy the prompt's blocks out of the pool into a new shared-memory file
        (``adapter``: the LoRA adapter they were computed with)."""
        started = time.perf_counter()
        num_blocks = len(block_ids)
        index = next(self._numbers)
        path = os.path.join(self.directory, f"{_PREFIX}{os.getpid()}-{self.instance_id}-{index}")
        shape = self.layout.blocks_shape(num_blocks)
        nbytes = num_blocks * self.layout.bytes_per_block
        try:
            handle = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(handle, nbytes)
            finally:
                os.close(handle)
            data = torch.from_file(path, shared=True, size=math.prod(shape), dtype=self.pool.dtype).view(shape)
            torch.index_select(self.pool, 2, torch.tensor(block_ids, dtype=torch.int64), out=data)
        except (OSError, RuntimeError) as error:
            remove_file(path)
            raise StagingError(f"staging {num_blocks} KV blocks in {self.directory} failed: {error}") from error
        staged = StagedKV(f"{self.instance_id}-{index}", self.instance_id, index, len(token_ids), num_blocks,
                          token_hash(token_ids), path, self.endpoint, self.layout, adapter)
        with self._lock:
            self._reserved.pop(request_id, None)
            self._entries[index] = _Entry(staged, nbytes, time.monotonic() + self.timeout_s, data)
            self._by_request[request_id] = staged
        self.stats.staged += 1
        self.stats.staged_bytes += nbytes
        self.stats.stage_seconds += time.perf_counter() - started
        return staged

    def take_staged(self, request_id: str) -> StagedKV | None:
        """The descriptor of what ``stage`` staged for the request (once)."""
        with self._lock:
            return self._by_request.pop(request_id, None)

    def sweep(self, now: float | None = None) -> None:
        """Drop entries past their deadline and those whose file a puller removed."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [i for i, e in self._entries.items() if now > e.deadline or not os.path.exists(e.staged.path)]
        for index in gone:
            entry = self._pop(index)
            if entry is not None:
                expired = os.path.exists(entry.staged.path)
                if expired:
                    self.stats.expired += 1
                    logger.warning("staged KV %s was not pulled within %.0f s: dropped", entry.staged.key,
                                   self.timeout_s)
                else:
                    self.stats.pulled += 1
                remove_file(entry.staged.path)

    def close(self) -> None:
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            remove_file(entry.staged.path)

    # ---- any thread ---------------------------------------------------------------------
    def read(self, index: int, first_block: int, num_blocks: int) -> torch.Tensor | None:
        """Blocks ``[first_block, first_block + num_blocks)`` of a staged prompt (a view of
        its pages), or None when it is gone or the range is outside it."""
        with self._lock:
            entry = self._entries.get(index)
        if entry is None or first_block < 0 or num_blocks < 0 or first_block + num_blocks > entry.staged.num_blocks:
            return None
        return entry.data[:, :, first_block:first_block + num_blocks]

    def drop(self, index: int) -> None:
        """The last puller is done with it."""
        entry = self._pop(index)
        if entry is not None:
            self.stats.pulled += 1
            remove_file(entry.staged.path)

    @property
    def num_staged(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used_bytes()

    def check_integrity(self) -> None:
        with self._lock:
            used = self._used_bytes()
            if used > self.budget_bytes and (len(self._reserved) + len(self._entries)) > 1:
                raise AssertionError(f"staging holds {used} bytes over its budget of {self.budget_bytes}")

    def _used_bytes(self) -> int:
        return sum(self._reserved.values()) + sum(e.nbytes for e in self._entries.values())

    def _pop(self, index: int) -> _Entry | None:
        with self._lock:
            return self._entries.pop(index, None)


_PREFIX = "kvloom-kv-"  # then the staging process's pid, its instance id, the entry's number


def is_staged_file(path: str, directory: str, instance_id: str, index: int) -> bool:
    """Whether ``path`` names entry ``index`` of prefill instance ``instance_id``, as
    ``stage`` names it in ``directory``: the only files a decode instance maps (and,
    after the last pull, deletes). A descriptor comes from whoever sent the request;
    any other path is not ours to read or remove."""
    name = re.escape(_PREFIX) + r"\d+-" + re.escape(f"{instance_id}-{index}")
    return (re.fullmatch(name, os.path.basename(path)) is not None
            and os.path.realpath(os.path.dirname(path)) == os.path.realpath(directory))


def remove_orphans(directory: str) -> int:
    """Remove staged files whose prefill process is gone (killed before it could clean
    up): nobody can pull them any more. Returns how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        pid = name[len(_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            remove_file(os.path.join(directory, name))
            removed += 1
    if removed:
        logger.info("removed %d staged KV files of prefill processes that are gone", removed)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_file(path: str) -> None:
    """Remove a staged file; one already gone (its puller removed it) is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
