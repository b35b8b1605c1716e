"""How a decode instance pulls staged KV blocks: the ``KVTransport`` seam and its two
transports, by ``--kv-transport``.

- ``shm``: the staged file in shared memory is mapped and the blocks copied straight
  into the pool (one copy; same host).
- ``torch``: torch.distributed point-to-point (gloo on CPU) with the prefill
  instance's ``KVServer``. Each decode instance forms its own two-rank gloo group with
  each prefill instance it pulls from, through a TCPStore the server listens on; the
  pair's handshake compares the two ``KVLayout``s and refuses a mismatch. A pull is a
  store key ``[index, first_block, num_blocks, last]``, answered found or not, then
  the blocks over gloo.

A transport runs on the decode side's transfer thread, never the engine's: the blocks
it writes belong to a request that no step touches until the transfer is reported.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

# The store and the gloo group, built directly (no default process group: each pair is its own).
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore

from kvloom.kv_spec import KVLayout, StagedKV
from kvloom.kv_transfer.staging import KVStaging, is_staged_file, remove_file
from kvloom.native import release_openmp_team

logger = logging.getLogger(__name__)


class TransferFailed(RuntimeError):
    """The blocks could not be pulled (the prefill instance is gone, the entry expired,
    the layouts differ): the request computes its prompt here instead."""


class KVTransport(Protocol):
    name: str

    def pull(self, staged: StagedKV, first_block: int, num_blocks: int, pool: torch.Tensor,
             block_ids: list[int], last: bool) -> int:
        """Copy staged blocks ``[first_block, first_block + num_blocks)`` into the pool's
        ``block_ids``; ``last``: no request here pulls it again. Returns the bytes moved;
        raises TransferFailed."""
        ...

    def refusal(self, staged: StagedKV) -> str | None:
        """Why this transport will not pull ``staged`` (checked when its request
        arrives: the descriptor comes from the request's sender), or None."""
        ...

    def close(self) -> None: ...


class SharedMemoryTransport:
    """Maps staged files of ``directory`` (this instance's ``--kv-shm-dir``, where the
    prefill instances on this host stage them) and no other path."""

    name = "shm"

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def refusal(self, staged: StagedKV) -> str | None:
        # The one gate: DecodeTransfer.accept drops a refused descriptor, so pull never sees it.
        if is_staged_file(staged.path, self.directory, staged.instance_id, staged.index):
            return None
        return (f"its path {staged.path!r} is not staged KV file {staged.index} of prefill instance "
                f"{staged.instance_id} in {self.directory}")

    def pull(self, staged: StagedKV, first_block: int, num_blocks: int, pool: torch.Tensor,
             block_ids: list[int], last: bool) -> int:
        shape = staged.layout.blocks_shape(staged.num_blocks)
        try:
            if os.path.getsize(staged.path) != staged.num_blocks * staged.layout.bytes_per_block:
                raise TransferFailed(f"staged KV {staged.key} at {staged.path} has the wrong size")
            data = torch.from_file(staged.path, shared=False, size=math.prod(shape), dtype=pool.dtype).view(shape)
        except OSError as error:
            raise TransferFailed(f"staged KV {staged.key} is gone from {staged.path} ({error}): the prefill "
                                 "instance dropped it (expired) or stopped") from None
        source = data[:, :, first_block:first_block + num_blocks]
        if num_blocks:
            pool.index_copy_(2, torch.tensor(block_ids, dtype=torch.int64), source)
        if last:
            remove_file(staged.path)  # the prefill side's sweep notices and frees its budget
        return source.numel() * source.element_size()

    def close(self) -> None:
        pass


class TorchTransport:
    """The decode side of the torch.distributed transport: one pair (a TCPStore client
    for the requests, a two-rank gloo group for the blocks) per prefill instance, made
    on the first pull from it (the handshake) and kept."""

    name = "torch"

    def __init__(self, layout: KVLayout, timeout_s: float) -> None:
        self.layout = layout
        self.timeout = timedelta(seconds=timeout_s)
        self._pairs: dict[str, _Pair] = {}

    def refusal(self, staged: StagedKV) -> str | None:
        return None if staged.endpoint is not None else "it names no torch.distributed endpoint"

    def pull(self, staged: StagedKV, first_block: int, num_blocks: int, pool: torch.Tensor,
             block_ids: list[int], last: bool) -> int:
        if staged.endpoint is None:
            raise TransferFailed(f"staged KV {staged.key} names no torch.distributed endpoint")
        try:
            pair = self._pair(staged.endpoint, staged.instance_id)
            found = pair.ask([staged.index, first_block, num_blocks, int(last)])
            if not found:
                raise TransferFailed(f"staged KV {staged.key} is no longer held by {staged.endpoint} (expired)")
            if not num_blocks:  # only telling the server that this instance is done with it
                return 0
            data = torch.empty(staged.layout.blocks_shape(num_blocks), dtype=pool.dtype)
            pair.group.recv([data], 0, 0).wait()
        except TransferFailed:
            raise
        except (RuntimeError, OSError, ValueError, dist.DistError) as error:
            self._pairs.pop(staged.endpoint, None)
            raise TransferFailed(f"pulling staged KV {staged.key} from {staged.endpoint} failed: {error}") from None
        pool.index_copy_(2, torch.tensor(block_ids, dtype=torch.int64), data)
        return data.numel() * data.element_size()

    def _pair(self, endpoint: str, instance_id: str) -> _Pair:
        known = self._pairs.get(endpoint)
        if known is not None:
            return known
        host, port = endpoint.rsplit(":", 1)
        # A plain connect first: TCPStore retries a refused one until its timeout, and a
        # prefill instance that is gone should fail the pull at once.
        try:
            socket.create_connection((host, int(port)), timeout=min(5.0, self.timeout.total_seconds())).close()
        except OSError as error:
            raise TransferFailed(f"the prefill instance at {endpoint} is unreachable ({error})") from None
        store = TCPStore(host, int(port), is_master=False, timeout=self.timeout)
        number = store.add("peers", 1) - 1
        store.set(f"peer/{number}/layout", json.dumps(self.layout.as_dict()))
        store.set(f"peer/{number}/instance", instance_id)
        verdict = store.get(f"peer/{number}/verdict").decode()
        if verdict != "ok":
            raise TransferFailed(f"{endpoint} refused this decode instance: {verdict}")
        group = ProcessGroupGloo(PrefixStore(f"pair/{number}", store), 1, 2, self.timeout)
        pair = self._pairs[endpoint] = _Pair(store, group, number)
        return pair

    def close(self) -> None:
        self._pairs.clear()


@dataclass
class _Pair:
    """A decode instance's link to one prefill instance: pulls are numbered store keys
    ``pull/<pair>/<seq>`` answered under ``answer/<pair>/<seq>``; the blocks follow
    over the gloo group."""

    store: TCPStore
    group: Any  # a ProcessGroupGloo (torch's stubs omit its send and recv)
    number: int
    seq: int = 0

    def ask(self, request: list[int]) -> bool:
        key = f"{self.number}/{self.seq}"
        self.seq += 1
        self.store.set(f"pull/{key}", json.dumps(request))
        found = bool(self.store.get(f"answer/{key}") == b"1")
        self.store.delete_key(f"answer/{key}")
        return found


class KVServer:
    """The prefill side of the torch.distributed transport: a TCPStore at ``host:port``
    (0: a free port) that decode instances join, and one thread that admits them
    (the layout handshake) and answers their pulls from the staging area, one at a
    time (they share the link's bandwidth anyway). It polls the store in Python, so
    that it can always stop: every ``POLL_S`` after activity, backing off to
    ``IDLE_POLL_S`` while nobody pulls (each poll is a store round trip, taken from the
    prefill engine's core); the blocks go over gloo."""

    POLL_S = 0.002
    IDLE_POLL_S = 0.05

    def __init__(self, staging: KVStaging, layout: KVLayout, instance_id: str, host: str, port: int,
                 timeout_s: float) -> None:
        self.staging, self.layout, self.instance_id = staging, layout, instance_id
        self.timeout = timedelta(seconds=timeout_s)
        self.store = TCPStore(host, port, is_master=True, timeout=self.timeout, wait_for_workers=False)
        self.endpoint = f"{host}:{self.store.port}"
        # peer number -> its pair's ProcessGroupGloo (torch's stubs omit send and recv)
        self._groups: dict[int, Any] = {}
        self._seqs: dict[int, int] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        next_peer = 0
        wait = self.POLL_S
        while not self._stopping.is_set():
            busy = False
            if self.store.check([f"peer/{next_peer}/instance"]):
                self._admit(next_peer)
                next_peer += 1
                busy = True
            for number in list(self._groups):
                key = f"{number}/{self._seqs[number]}"
                if self.store.check([f"pull/{key}"]):
                    self._answer(number, key)
                    self._seqs[number] += 1
                    busy = True
            if busy:
                wait = self.POLL_S
            else:
                self._stopping.wait(wait)
                wait = min(2 * wait, self.IDLE_POLL_S)

    def _admit(self, number: int) -> None:
        try:
            theirs = KVLayout.from_dict(json.loads(self.store.get(f"peer/{number}/layout")))
            problem = self.layout.mismatch(theirs)
        except ValueError as error:
            problem = f"its layout is unreadable ({error})"
        instance = self.store.get(f"peer/{number}/instance").decode()
        if instance != self.instance_id:
            problem = f"it asked for prefill instance {instance}, this is {self.instance_id}"
        self.store.set(f"peer/{number}/verdict", "ok" if problem is None else
                       "instances of a different model, dtype, block size or cache layout cannot share "
                       f"KV: {problem}")
        if problem is not None:
            logger.warning("refused decode instance %d: %s", number, problem)
            return
        self._groups[number] = ProcessGroupGloo(PrefixStore(f"pair/{number}", self.store), 0, 2,
                                                     self.timeout)
        self._seqs[number] = 0

    def _answer(self, number: int, key: str) -> None:
        index, first_block, num_blocks, last = json.loads(self.store.get(f"pull/{key}"))
        self.store.delete_key(f"pull/{key}")
        data = self.staging.read(index, first_block, num_blocks)
        if data is not None and last:
            self.staging.drop(index)  # before answering: the view keeps the pages until sent
        self.store.set(f"answer/{key}", "1" if data is not None else "0")
        if data is None or not num_blocks:
            return
        try:
            self._groups[number].send([data.contiguous()], 1, 0).wait()
        except (RuntimeError, dist.DistError) as error:
            logger.info("decode instance %d left while pulling: %s", number, error)
            del self._groups[number]
        finally:
            release_openmp_team()  # the copy's OpenMP team, as DecodeTransfer._run does

    def close(self) -> None:
        """Stop answering; the store's socket closes with the last reference to it, so
        decode instances that ask later fail at once instead of at their timeout."""
        self._stopping.set()
        self._thread.join(timeout=5.0)
        self._groups.clear()
        del self.store


TRANSPORTS = {"shm": SharedMemoryTransport, "torch": TorchTransport}
