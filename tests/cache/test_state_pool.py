"""StatePool: one state slot per running request, books checked by check_integrity."""

from __future__ import annotations

import pytest

from kvloom.cache.block_pool import BlockPoolError
from kvloom.cache.state_pool import NoStatePool, StatePool
from kvloom.request import Request
from kvloom.sampling_params import SamplingParams


def request(request_id: str) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(max_tokens=2))


def test_slots_are_given_once_and_come_back() -> None:
    pool = StatePool(2)
    a, b, c = request("a"), request("b"), request("c")
    pool.allocate(a)
    pool.allocate(b)
    assert {a.state_slot, b.state_slot} == {0, 1} and not pool.has_free_slot
    pool.check_integrity([a, b, c])
    with pytest.raises(BlockPoolError, match="no free state slot"):
        pool.allocate(c)
    pool.free(a)
    assert a.state_slot is None and pool.num_free_slots == 1
    pool.free(a)  # holds none: nothing to do
    pool.allocate(c)
    pool.check_integrity([b, c])
    with pytest.raises(BlockPoolError, match="already holds"):
        pool.allocate(c)


def test_integrity_catches_a_stale_owner_and_a_forged_slot() -> None:
    pool = StatePool(3)
    a, b = request("a"), request("b")
    pool.allocate(a)
    with pytest.raises(BlockPoolError, match="no longer live"):
        pool.check_integrity([])
    b.state_slot = a.state_slot  # written behind the pool's back
    with pytest.raises(BlockPoolError, match="does not give it"):
        pool.check_integrity([a, b])
    with pytest.raises(BlockPoolError, match="does not own"):
        pool.free(b)
    b.state_slot = None
    pool._free.append(a.state_slot)  # a slot both free and owned
    with pytest.raises(BlockPoolError, match="free and owned"):
        pool.check_integrity([a])


def test_the_null_pool_always_has_room_and_holds_nothing() -> None:
    pool, a = NoStatePool(), request("a")
    pool.allocate(a)
    assert pool.has_free_slot and a.state_slot is None
    pool.check_integrity([a])
    a.state_slot = 0
    with pytest.raises(BlockPoolError, match="without a state pool"):
        pool.check_integrity([a])


def test_a_pool_needs_a_slot() -> None:
    with pytest.raises(ValueError, match="num_state_slots"):
        StatePool(0)
