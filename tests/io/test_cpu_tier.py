"""L1 CPU tier: evict-and-retry allocation, what may be evicted, in-flight
entries (a reader waits for the store), and the slot allocator option."""

from __future__ import annotations

import asyncio

import pytest
import torch
from io_helpers import DTYPE, SHAPE, key

from kvstrata.io import CPUConfig, CPUTier


def make_l1(tracker, objs=4, **kw) -> CPUTier:
    return tracker.add(CPUTier(CPUConfig(capacity_bytes=objs * 8192, pin_memory=False, **kw)))


def fill(l1: CPUTier, *ids: int) -> None:
    for i in ids:
        obj = l1.allocate(SHAPE, DTYPE)
        assert obj is not None
        obj.tensor.fill_(i)
        assert l1.put(key(i), obj)
        obj.release()


def keys_in(l1: CPUTier, ids=range(10)) -> list[int]:
    return [i for i in ids if l1.contains(key(i))]


def test_allocation_evicts_by_policy_and_retries(tracker):
    l1 = make_l1(tracker)
    fill(l1, 0, 1, 2, 3)
    l1.touch([key(0)])
    fill(l1, 4, 5)
    assert keys_in(l1) == [0, 3, 4, 5]
    assert l1.stats().evictions == 2 and l1.stats().num_objects == 4


def test_pinned_and_referenced_objects_are_not_evicted(tracker):
    l1 = make_l1(tracker, objs=3)
    fill(l1, 0, 1, 2)
    assert l1.pin(key(0))
    held = l1.take(key(1))
    fill(l1, 3)
    assert keys_in(l1) == [0, 1, 3]
    fill(l1, 4)  # only 3 is evictable now
    assert keys_in(l1) == [0, 1, 4]
    held.release()
    l1.unpin(key(0))


def test_nothing_evictable_returns_none_and_changes_nothing(tracker):
    l1 = make_l1(tracker, objs=2)
    fill(l1, 0, 1)
    l1.pin(key(0))
    l1.pin(key(1))
    assert l1.allocate(SHAPE, DTYPE) is None
    assert keys_in(l1) == [0, 1] and l1.stats().evictions == 0
    assert l1.allocate((3 * 8192,), torch.uint8) is None  # can never fit: evicts nothing
    l1.unpin(key(0))
    l1.unpin(key(1))


def test_put_of_a_present_key_is_a_no_op(tracker):
    l1 = make_l1(tracker)
    fill(l1, 0)
    obj = l1.allocate(SHAPE, DTYPE)
    assert not l1.put(key(0), obj)
    obj.release()
    assert l1.stats().puts == 1


async def test_a_reader_waits_for_an_in_flight_store(tracker):
    l1 = make_l1(tracker)
    obj = l1.allocate(SHAPE, DTYPE)
    ready = asyncio.get_running_loop().create_future()
    assert l1.put(key(0), obj, ready)
    obj.release()
    assert l1.contains(key(0)) and l1.in_flight(key(0)) is ready
    other = l1.allocate(SHAPE, DTYPE)  # room, without touching the in-flight one
    assert other is not None
    waiter = asyncio.create_task(l1.wait_ready(key(0)))
    await asyncio.sleep(0)
    assert not waiter.done()
    ready.set_result(None)
    assert await waiter is True
    assert l1.in_flight(key(0)) is None
    other.release()


async def test_a_failed_store_is_removed_and_waiters_miss(tracker):
    l1 = make_l1(tracker)
    obj = l1.allocate(SHAPE, DTYPE)
    ready = asyncio.get_running_loop().create_future()
    l1.put(key(0), obj, ready)
    obj.release()
    waiter = asyncio.create_task(l1.wait_ready(key(0)))
    await asyncio.sleep(0)
    ready.set_exception(RuntimeError("copy failed"))
    assert await waiter is False
    assert not l1.contains(key(0)) and l1.allocator.num_live == 0


async def test_cancelling_a_waiter_does_not_cancel_the_store(tracker):
    l1 = make_l1(tracker)
    obj = l1.allocate(SHAPE, DTYPE)
    ready = asyncio.get_running_loop().create_future()
    l1.put(key(0), obj, ready)
    obj.release()
    waiter = asyncio.create_task(l1.wait_ready(key(0)))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not ready.cancelled()
    ready.set_result(True)
    await asyncio.sleep(0)
    assert l1.contains(key(0))


def test_in_flight_entries_are_not_removed(tracker):
    l1 = make_l1(tracker)
    fill(l1, 0)
    l1.pin(key(0))
    assert not l1.remove(key(0))
    l1.unpin(key(0))
    assert l1.remove(key(0)) and not l1.remove(key(0))


def test_batched_allocate_falls_back_to_evicting_one_by_one(tracker):
    l1 = make_l1(tracker, objs=4)
    fill(l1, 0, 1, 2, 3)
    objs = l1.batched_allocate(2, SHAPE, DTYPE)
    assert objs is not None and keys_in(l1) == [2, 3]
    for o in objs:
        o.release()
    l1.pin(key(2))
    l1.pin(key(3))
    fill(l1, 4, 5)
    objs = l1.batched_allocate(2, SHAPE, DTYPE)
    assert objs is not None and keys_in(l1) == [2, 3]
    assert l1.batched_allocate(1, SHAPE, DTYPE) is None  # all or nothing, nothing evictable
    for o in objs:
        o.release()
    l1.unpin(key(2))
    l1.unpin(key(3))


def test_the_layers_of_a_chunk_are_evicted_together(tracker):
    l1 = make_l1(tracker, objs=5)
    layers = key(0).layer_keys(3)
    for k in layers:
        obj = l1.allocate(SHAPE, DTYPE)
        l1.put(k, obj)
        obj.release()
    fill(l1, 1, 2)
    l1.pin(layers[2])  # a pinned layer stays
    fill(l1, 3)  # victim: layer 0 (LRU), and layer 1 with it
    assert [k for k in layers if l1.contains(k)] == [layers[2]]
    assert keys_in(l1) == [1, 2, 3] and l1.stats().evictions == 2
    l1.unpin(layers[2])


def test_slot_allocator_l1(tracker):
    l1 = make_l1(tracker, objs=3, allocator="slots", slot_bytes=8192)
    fill(l1, 0, 1, 2, 3)
    assert keys_in(l1) == [1, 2, 3]
    assert l1.allocate((8193,), torch.uint8) is None


def test_l1_config_errors_name_the_field():
    with pytest.raises(ValueError, match="cpu.slot_bytes"):
        CPUTier(CPUConfig(allocator="slots"))
    with pytest.raises(ValueError, match="cpu.policy"):
        CPUTier(CPUConfig(policy="clock"))
    with pytest.raises(ValueError, match="cpu.capacity_bytes"):
        CPUTier(CPUConfig(capacity_bytes=10))
