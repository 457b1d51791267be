"""Events from every tier: BlockStored when the first copy of a chunk lands
in a medium, BlockRemoved only when the last copy in that medium goes."""

from __future__ import annotations

import torch
from conn_helpers import disk_tier

from kvstrata.io import ChunkKey, StorageManager, StoreConfig, TierRegistry
from kvstrata.io.config import CPUConfig, TierSpec
from kvstrata.connector.events import ChunkInfo, ObservedTier, TierEventRecorder, device_events, medium_of
from kvstrata.kv.events import BlockRemoved, BlockStored

IDENT = "0123456789abcdef0123456789abcdef"


def key(i: int) -> ChunkKey:
    return ChunkKey(IDENT, bytes([i]) * 32, 8)


def info(i: int) -> ChunkInfo:
    return ChunkInfo([bytes([i, 0]) * 16, bytes([i, 1]) * 16], None if i == 0 else bytes([i - 1, 1]) * 16,
                     list(range(8 * i, 8 * i + 8)))


def stored(i: int, medium: str) -> BlockStored:
    ci = info(i)
    return BlockStored(block_hashes=list(ci.block_hashes), parent_block_hash=ci.parent,
                       token_ids=list(ci.tokens), block_size=4, medium=medium)


def removed(i: int, medium: str) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(info(i).block_hashes), medium=medium)


def test_media_of_tier_kinds():
    assert [medium_of(k) for k in ("cpu", "disk", "redis", "fs", "s3")] == ["CPU", "DISK", "REMOTE", "REMOTE", "REMOTE"]


def test_device_events_are_renamed_gpu():
    ev = [BlockStored(block_hashes=[b"x"], parent_block_hash=None, token_ids=[1], block_size=1),
          BlockRemoved(block_hashes=[b"x"])]
    assert [e.medium for e in device_events(ev)] == ["GPU", "GPU"]


def test_a_removal_is_published_only_when_the_last_copy_in_the_medium_goes():
    rec = TierEventRecorder({"cpu": "cpu", "d1": "disk", "d2": "disk", "redis": "redis"}, block_size=4)
    rec.describe(key(1), info(1))
    rec.stored(key(1), "cpu")
    rec.stored(key(1), "d1")
    rec.stored(key(1), "d2")
    rec.stored(key(1), "d2")
    rec.stored(key(1), "redis")
    assert rec.take() == [stored(1, "CPU"), stored(1, "DISK"), stored(1, "REMOTE")]
    rec.removed(key(1), "d1")
    assert rec.take() == []
    rec.removed(key(1), "d2")
    rec.removed(key(1), "cpu")
    rec.removed(key(1), "cpu")
    assert rec.take() == [removed(1, "DISK"), removed(1, "CPU")]
    rec.removed(key(1), "redis")
    assert rec.take() == [removed(1, "REMOTE")]
    assert rec.holders(key(1)) == set()
    rec.stored(key(1), "cpu")  # forgotten with its last copy: no description, nothing published
    assert rec.take() == []


def test_an_undescribed_chunk_is_not_published():
    rec = TierEventRecorder({"cpu": "cpu"}, block_size=4)
    rec.stored(key(2), "cpu")
    rec.removed(key(2), "cpu")
    assert rec.take() == []


async def test_observed_disk_tiers_put_remove_and_evict(tmp_path):
    registry = TierRegistry()
    rec = TierEventRecorder({"cpu": "cpu", "d1": "disk", "d2": "disk"}, block_size=4)
    small = TierSpec(**disk_tier(tmp_path / "d1", chunks=1, chunk_bytes=4096, name="d1"))
    big = TierSpec(**disk_tier(tmp_path / "d2", chunks=8, chunk_bytes=4096, name="d2"))
    tiers = [ObservedTier(registry.build(s, "t"), rec) for s in (small, big)]
    store = StorageManager(StoreConfig(cpu=CPUConfig(capacity_bytes=1 << 16, pin_memory=False)), tiers=tiers)
    await store.start()
    try:
        for i in (1, 2):
            rec.describe(key(i), info(i))
            obj = store.allocate((1024,), torch.float32, "t")
            store.put(key(i), obj)
            obj.release()
            await store.drain()
        # d1 holds one object: putting key 2 evicted key 1 there, but d2 still has it.
        assert rec.take() == [stored(1, "DISK"), stored(2, "DISK")]
        assert rec.holders(key(1)) == {"d2"} and rec.holders(key(2)) == {"d1", "d2"}
        assert store.tiers[1].submit_remove(key(1))
        assert rec.take() == [removed(1, "DISK")]
        assert store.tiers[0].submit_remove(key(2))
        assert rec.take() == []
        assert await store.lookup([key(2)]) == 1
        for f in (tmp_path / "d2").rglob("*"):
            if f.is_file():
                f.unlink()  # deleted under the tier: the next read finds it gone
        store.l1.clear()
        assert await store.get([key(2)]) == []
        await store.drain()
        assert rec.take() == [removed(2, "DISK")]
    finally:
        await store.aclose()
