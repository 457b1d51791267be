"""StorageManager: put / lookup / get across tiers, in-flight stores, pins,
cancellation, per-layer keys, faults isolated to their tier, stats, close."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch
from io_helpers import DTYPE, SHAPE, get_ids, key, pattern, pin_leading, put_all, put_pattern

from kvstrata.io import CPUConfig, StorageManager, StoreConfig, StoreIdentity, TierSpec


async def test_lookup_and_get_stop_at_the_first_gap(make_store):
    store = await make_store()
    for i in (0, 1, 3):
        put_pattern(store, i)
    ks = [key(i) for i in range(4)]
    assert await store.lookup(ks) == 2
    assert await get_ids(store, [0, 1, 2, 3]) == [0, 1]
    assert await store.lookup([key(3)]) == 1 and await store.lookup([]) == 0
    s = store.stats()
    assert (s.lookups, s.lookup_chunks, s.lookup_hit_chunks) == (3, 5, 3)
    assert (s.tier("cpu").hit_chunks, s.tier("cpu").miss_chunks, s.tier("cpu").miss_tokens) == (2, 1, 256)


async def test_a_second_put_of_a_key_is_a_no_op(make_store):
    store = await make_store()
    put_pattern(store, 0)
    obj = store.allocate(SHAPE, DTYPE, "test")
    assert not store.put(key(0), obj)
    obj.release()
    with pytest.raises(ValueError, match="keys and objs"):
        store.batched_put([key(1)], [])


async def test_batched_allocate_and_put(make_store):
    store = await make_store()
    objs = store.batched_allocate(3, SHAPE, DTYPE, "test")
    for i, o in enumerate(objs):
        o.tensor.copy_(pattern(i))
    assert store.batched_put([key(i) for i in range(3)], objs) == 3
    for o in objs:
        o.release()
    assert await get_ids(store, [0, 1, 2]) == [0, 1, 2]


async def test_get_waits_for_an_in_flight_store_and_lower_tiers_wait_too(make_store, disk_tier_spec, tmp_path):
    store = await make_store(tiers=[disk_tier_spec(tmp_path / "disk")])
    obj = store.allocate(SHAPE, DTYPE, "test")
    copied = asyncio.get_running_loop().create_future()
    assert store.put(key(0), obj, ready=copied)
    getter = asyncio.create_task(get_ids(store, [0]))
    await asyncio.sleep(0.01)
    assert not getter.done() and store.stats().tier("disk").puts == 0
    obj.tensor.copy_(pattern(0))  # the "device copy" lands, then completes
    obj.release()
    copied.set_result(None)
    assert await getter == [0]
    await store.drain()
    assert store.tiers[0].has(key(0))


async def test_a_failed_in_flight_store_is_a_miss_everywhere(make_store, disk_tier_spec, tmp_path):
    store = await make_store(tiers=[disk_tier_spec(tmp_path / "disk")])
    obj = store.allocate(SHAPE, DTYPE, "test")
    copied = asyncio.get_running_loop().create_future()
    store.put(key(0), obj, ready=copied)
    obj.release()
    getter = asyncio.create_task(get_ids(store, [0]))
    await asyncio.sleep(0)
    copied.cancel()
    assert await getter == []
    await store.drain()
    assert not store.tiers[0].has(key(0)) and await store.lookup([key(0)]) == 0


async def test_cancelling_get_releases_everything(make_store):
    store = await make_store()
    put_pattern(store, 0)
    obj = store.allocate(SHAPE, DTYPE, "test")
    copied = asyncio.get_running_loop().create_future()
    store.put(key(1), obj, ready=copied)
    obj.release()
    getter = asyncio.create_task(store.get([key(0), key(1)]))
    await asyncio.sleep(0)
    getter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await getter
    assert store.outstanding().referenced == 0
    copied.set_result(True)
    await asyncio.sleep(0)


async def test_get_reads_the_fastest_tier_that_has_the_chunk(make_store, disk_tier_spec, tmp_path):
    fs = TierSpec(type="fs", options=dict(path=str(tmp_path / "fs")))
    store = await make_store(tiers=[disk_tier_spec(tmp_path / "disk"), fs])
    put_pattern(store, 0)
    put_pattern(store, 1)
    await store.drain()
    store.l1.remove(key(0))
    store.l1.remove(key(1))
    store.tiers[0].submit_remove(key(1))  # only the fs tier keeps 1
    await store.drain()
    assert await get_ids(store, [0, 1]) == [0, 1]
    s = store.stats()
    assert (s.tier("disk").hit_chunks, s.tier("disk").miss_chunks) == (1, 1)
    assert (s.tier("fs").hit_chunks, s.tier("fs").miss_chunks) == (1, 0)


async def test_pins_keep_chunks_from_eviction_until_released(make_store):
    store = await make_store(cpu_objs=2)
    put_pattern(store, 0)
    put_pattern(store, 1)
    both = await pin_leading(store, [key(0), key(1), key(9)])
    assert both == [(key(0), 0), (key(1), 0)]  # the leading chunks held, each where it is
    again = await pin_leading(store, [key(0)])
    assert store.outstanding().pinned == 2
    assert store.allocate(SHAPE, DTYPE) is None
    store.release_pins(both)
    assert store.outstanding().pinned == 1  # key 0 still pinned once
    assert put_pattern(store, 2) is not None
    assert store.l1.contains(key(0)) and not store.l1.contains(key(1))
    store.release_pins(again)
    assert store.outstanding().pinned == 0


async def test_per_layer_keys_round_trip_through_disk(make_store, disk_tier_spec, tmp_path):
    store = await make_store(tiers=[disk_tier_spec(tmp_path / "disk")])
    layers = key(0).layer_keys(3)
    for n, k in enumerate(layers):
        obj = store.allocate(SHAPE, DTYPE, "layer")
        obj.tensor.copy_(pattern(10 + n))
        store.put(k, obj)
        obj.release()
    await store.drain()
    for k in layers:
        store.l1.remove(k)
    objs = await store.get(layers)
    assert [torch.equal(o.tensor, pattern(10 + n)) for n, o in enumerate(objs)] == [True] * 3
    for o in objs:
        o.release()
    d = store.stats().tier("disk")
    assert (d.hit_chunks, d.hit_tokens) == (3, 256)  # tokens counted once, on layer 0
    assert await store.lookup([key(0)]) == 0  # the whole-chunk key is a different object


async def test_one_faulty_tier_does_not_stop_the_others(make_store, disk_tier_spec, redis_factory, tmp_path):
    down = redis_factory(start=False)
    store = await make_store(tiers=[TierSpec(type="redis", options=down.options()),
                                    disk_tier_spec(tmp_path / "disk")])
    put_pattern(store, 0)
    await store.drain()
    store.l1.remove(key(0))
    assert await get_ids(store, [0]) == [0]
    s = store.stats()
    assert not s.tier("redis").available and s.tier("redis").dropped_puts == 1
    assert s.tier("disk").hit_chunks == 1


async def test_close_finishes_queued_writes_and_is_idempotent(make_store, disk_tier_spec, tmp_path):
    store = await make_store(tiers=[disk_tier_spec(tmp_path / "disk")])
    for i in range(3):
        put_pattern(store, i)
    await store.aclose()
    assert len(list((tmp_path / "disk").rglob("*.kvs"))) == 3
    await store.aclose()
    obj = store.allocate(SHAPE, DTYPE)
    assert obj is not None and not store.put(key(5), obj)
    obj.release()
    assert await store.get([key(0)]) == [] and await store.lookup([key(0)]) == 0


async def test_stats_are_a_msgspec_struct(make_store):
    store = await make_store()
    put_pattern(store, 0)
    await get_ids(store, [0])
    doc = msgspec.json.decode(msgspec.json.encode(store.stats()))
    assert doc["tiers"][0]["name"] == "cpu" and doc["tiers"][0]["hit_chunks"] == 1
    assert doc["tiers"][0]["capacity_bytes"] == 8 * 8192


async def test_keyer_follows_the_partial_chunk_setting(make_store):
    ident = StoreIdentity(model_fingerprint="m", kv_dtype="float32", kv_layout="per_layer",
                          block_size=16, hash_algo="sha256", chunk_size=32)
    hashes = [bytes([i]) * 8 for i in range(3)]
    assert len((await make_store()).keyer(ident).keys(hashes)) == 1
    assert len((await make_store(save_partial_chunks=True)).keyer(ident).keys(hashes)) == 2


def test_store_config_errors_name_the_field():
    with pytest.raises(ValueError, match="cpu.capacity_bytes"):
        StorageManager(StoreConfig(cpu=CPUConfig(capacity_bytes=0)))
    with pytest.raises(ValueError, match="close_timeout_s"):
        StorageManager(StoreConfig(close_timeout_s=0))


# --- the synchronous front door: probe, take_ready, pin, holds, sources ---------------

async def test_probe_answers_from_l1_and_local_indexes_without_io(make_store, disk_tier_spec, tmp_path):
    store = await make_store(tiers=[disk_tier_spec(tmp_path / "disk")])
    await put_all(store, [0, 1])
    store.l1.remove(key(1))  # only the disk keeps 1
    obj = store.allocate(SHAPE, DTYPE, "test")
    copied = asyncio.get_running_loop().create_future()
    store.put(key(2), obj, ready=copied)  # in flight in L1: not ready there
    obj.release()
    assert store.probe([key(0), key(1), key(2)]) == ([0, 1], True)
    assert store.probe([key(0), key(9), key(1)]) == ([0], True)  # stops at the first gap
    assert store.stats().lookups == 0  # no lookup counted, no I/O
    copied.set_result(True)
    await asyncio.sleep(0)
    await store.drain()
    assert store.probe([key(2)]) == ([0], True)


async def test_probe_is_not_definite_where_a_tier_must_be_asked(make_store, tmp_path):
    store = await make_store(tiers=[TierSpec(type="fs", options=dict(path=str(tmp_path / "fs")))])
    put_pattern(store, 0)
    await store.drain()
    store.l1.remove(key(0))
    assert store.probe([key(0)]) == ([], False)
    assert await store.locate([key(0)]) == [1]  # the fs tier, found by asking it
    assert store.stats().lookups == 1


async def test_a_tier_that_raises_is_a_miss_and_a_fault(make_store, disk_tier_spec, tmp_path):
    store = await make_store(tiers=[disk_tier_spec(tmp_path / "disk")])
    await put_all(store, [0])
    store.l1.remove(key(0))
    disk = store.tiers[0]

    def broken(k):
        raise RuntimeError("bug in the tier")

    disk.has = broken
    assert store.probe([key(0)]) == ([], True) and not store.holds(key(0))
    assert disk.counters.faults == 2
    del disk.has


async def test_take_ready_references_the_leading_ready_chunks(make_store):
    store = await make_store()
    for i in (0, 1, 3):
        put_pattern(store, i)
    objs = store.take_ready([key(0), key(1), key(2), key(3)])
    assert [torch.equal(o.tensor, pattern(i)) for i, o in enumerate(objs)] == [True, True]
    assert store.outstanding().referenced == 2
    for o in objs:
        o.release()
    assert store.stats().tier("cpu").hit_chunks == 0  # not a read: counted by the caller


async def test_pin_pins_in_the_named_source_and_release_pins_undoes_exactly_those(make_store, disk_tier_spec,
                                                                               tmp_path):
    store = await make_store(tiers=[disk_tier_spec(tmp_path / "disk")])
    await put_all(store, [0, 1])
    store.l1.remove(key(1))
    srcs, _ = store.probe([key(0), key(1)])
    pins = store.pin([key(0), key(1)], srcs)
    assert pins == [(key(0), 0), (key(1), 1)]
    assert store.l1.pinned_count() == 1 and store.tiers[0].pinned_count() == 1
    other = await pin_leading(store, [key(0)])  # another caller's pin stays apart
    store.release_pins(pins)
    assert store.outstanding().pinned == len(other) == 1
    store.release_pins(other)
    assert store.outstanding().pinned == 0


async def test_holds_counts_in_flight_l1_entries_and_local_tiers(make_store, disk_tier_spec, tmp_path):
    store = await make_store(tiers=[disk_tier_spec(tmp_path / "disk")])
    await put_all(store, [0])
    store.l1.remove(key(0))
    obj = store.allocate(SHAPE, DTYPE, "test")
    copied = asyncio.get_running_loop().create_future()
    store.put(key(1), obj, ready=copied)
    obj.release()
    assert store.holds(key(0)) and store.holds(key(1)) and not store.holds(key(2))
    assert store.in_l1(key(1)) and not store.in_l1(key(0))
    copied.set_result(True)
    await asyncio.sleep(0)
    await store.drain()


async def test_sources_name_the_tiers(make_store, disk_tier_spec, tmp_path):
    fs = TierSpec(type="fs", name="shared", options=dict(path=str(tmp_path / "fs")))
    store = await make_store(tiers=[disk_tier_spec(tmp_path / "disk"), fs])
    assert store.tier_names == ["cpu", "disk", "shared"]
    assert [store.source_name(s) for s in (0, 1, 2, 7)] == ["cpu", "disk", "shared", "unknown"]
    assert [store.is_local(s) for s in (0, 1, 2)] == [True, True, False]


async def test_the_write_listener_hears_every_lower_tier_write(make_store, disk_tier_spec, tmp_path):
    store = await make_store(tiers=[disk_tier_spec(tmp_path / "disk"),
                                    disk_tier_spec(tmp_path / "back", write="back", name="back")], cpu_objs=1)
    heard: list[int] = []
    store.set_write_listener(lambda: heard.append(len(heard)))
    put_pattern(store, 0)
    await store.drain()
    assert len(heard) == 1  # written through to "disk"
    put_pattern(store, 1)  # evicts 0 from L1: written back to "back" (no room for 1 until then)
    await store.drain()
    assert len(heard) == 2
    store.set_write_listener(None)
    assert put_pattern(store, 2) is not None
    await store.drain()
    assert len(heard) == 2
