"""StatePool: the books of a state-space model's per-request state slots.

A Mamba2 mixer keeps a fixed-size state per request instead of a growing KV cache:
its convolution's last inputs and its SSM state. Every mixer layer holds one such
state per slot (the tensors are the model's, indexed by slot: models/mamba2.py); a
running request owns exactly one slot from admission until it finishes, is aborted
or is preempted (it then recomputes into whichever slot it gets next). The mixers
scan a chunk that starts at token 0 from a zero state, and every later chunk from the
state the one before stored, so chunked prefill carries the state chunk to chunk. A
request that starts after a prefix-cache hit starts from the hit's state checkpoint,
copied into its slot first: checkpoints are slots too, numbered after these, but the
radix cache keeps their books (cache/radix_cache.py).

Like BlockPool, this is pure Python and never touches tensors. Ownership: the pool is
the one writer of ``Request.state_slot`` (the scheduler calls it, as it calls the KV
cache manager for ``block_ids``). ``NoStatePool`` is the null object for models
without mixers: every request fits and holds nothing.
"""

from __future__ import annotations

from collections import deque

from kvloom.cache.block_pool import BlockPoolError
from kvloom.request import Request


class StatePool:
    """``num_slots`` state slots; a request holds at most one."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_state_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._owners: dict[int, Request] = {}

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def has_free_slot(self) -> bool:
        return bool(self._free)

    def allocate(self, request: Request) -> None:
        """Give the request a slot (it holds none; callers check ``has_free_slot``)."""
        if request.state_slot is not None:
            raise BlockPoolError(f"request {request.request_id} already holds state slot {request.state_slot}")
        if not self._free:
            raise BlockPoolError(f"no free state slot for {request.request_id}")
        slot = self._free.popleft()
        self._owners[slot] = request
        request.state_slot = slot

    def free(self, request: Request) -> None:
        """Return the request's slot, if it holds one; its state is dead from now on."""
        slot = request.state_slot
        if slot is None:
            return
        if self._owners.get(slot) is not request:
            raise BlockPoolError(f"request {request.request_id} frees state slot {slot} it does not own")
        del self._owners[slot]
        self._free.append(slot)
        request.state_slot = None

    def check_integrity(self, live_requests: list[Request]) -> None:
        """free + owned == all slots, each once; every owner is live and names its slot;
        no live request holds a slot the books do not give it."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise BlockPoolError("a state slot appears twice in the free list")
        if free & self._owners.keys():
            raise BlockPoolError(f"state slots both free and owned: {sorted(free & self._owners.keys())}")
        if len(free) + len(self._owners) != self.num_slots or not all(0 <= s < self.num_slots for s in free):
            raise BlockPoolError(f"state slots: {len(free)} free + {len(self._owners)} owned != {self.num_slots}")
        live = set(live_requests)
        for slot, owner in self._owners.items():
            if owner.state_slot != slot:
                raise BlockPoolError(f"state slot {slot}: its owner {owner.request_id} holds {owner.state_slot}")
            if owner not in live:
                raise BlockPoolError(f"state slot {slot} held by {owner.request_id}, no longer live")
        for request in live_requests:
            if request.state_slot is not None and self._owners.get(request.state_slot) is not request:
                raise BlockPoolError(f"request {request.request_id} holds state slot {request.state_slot} "
                                     "the pool does not give it")


class NoStatePool(StatePool):
    """A model without state-space layers: there is always room and nothing is held."""

    def __init__(self) -> None:
        self.num_slots = 0

    @property
    def num_free_slots(self) -> int:
        return 0

    @property
    def has_free_slot(self) -> bool:
        return True

    def allocate(self, request: Request) -> None:
        return None

    def free(self, request: Request) -> None:
        return None

    def check_integrity(self, live_requests: list[Request]) -> None:
        holders = [r.request_id for r in live_requests if r.state_slot is not None]
        if holders:
            raise BlockPoolError(f"requests hold state slots without a state pool: {holders}")
