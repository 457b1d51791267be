"""KV cache events from every tier of the store, in the device's terms.

A chunk stored in a tier is published as ``BlockStored`` of its device blocks
(their hashes, the parent hash, the tokens, the device block size), so an
external router sees one vocabulary across media::

    medium   GPU (the device pool: KVCacheManager's events, renamed)
             CPU (L1)   DISK (local disk tiers)   REMOTE (Redis, shared fs, ...)

A medium may hold a chunk in several tiers (two disk tiers, Redis and a
shared filesystem): ``BlockStored`` is published when the first copy in the
medium appears, ``BlockRemoved`` only when the last copy in it goes.

How copies are seen: lower tiers through ``ObservedTier`` (a transparent
proxy handed to the StorageManager: completed puts, removals, lookups and
reads that find an object gone, evictions noticed through the tier's eviction
counter); L1 by the connector itself (puts and promotions it makes) and by a
sweep whenever L1's eviction counter moved (``StorageManager.l1_evictions``).
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvstrata.io import ChunkKey, LowerTier, MemoryObj, ObjectMeta, TierSpec
from kvstrata.kv.events import AnyKVCacheEvent, BlockRemoved, BlockStored

GPU, CPU, DISK, REMOTE = "GPU", "CPU", "DISK", "REMOTE"
_KIND_MEDIUM = {"cpu": CPU, "disk": DISK}


def medium_of(kind: str) -> str:
    """The medium of a tier kind: cpu -> CPU, disk -> DISK, anything else REMOTE."""
    return _KIND_MEDIUM.get(kind, REMOTE)


def device_events(events: Sequence[AnyKVCacheEvent]) -> list[AnyKVCacheEvent]:
    """The KV manager's events with the device medium named GPU."""
    return [e if e.medium in (GPU, None) else msgspec.structs.replace(e, medium=GPU) for e in events]


class ChunkInfo:
    """How to publish one chunk: its device block hashes, the hash before
    them (None at the start of a prompt) and its tokens."""

    __slots__ = ("block_hashes", "parent", "tokens")

    def __init__(self, block_hashes: Sequence[bytes], parent: bytes | None, tokens: Sequence[int]) -> None:
        self.block_hashes = tuple(block_hashes)
        self.parent = parent
        self.tokens = array("q", tokens)


class TierEventRecorder:
    """Owns: which tiers hold each chunk key it has heard of, each key's
    description, the events not yet taken and the eviction count last seen
    per tier. Loop only."""

    __slots__ = ("block_size", "_medium", "_holders", "_info", "_events", "_evictions")

    def __init__(self, tier_kinds: dict[str, str], block_size: int) -> None:
        self.block_size = block_size
        self._medium = {name: medium_of(kind) for name, kind in tier_kinds.items()}
        self._holders: dict[ChunkKey, set[str]] = {}
        self._info: dict[ChunkKey, ChunkInfo] = {}
        self._events: list[AnyKVCacheEvent] = []
        self._evictions: dict[str, int] = {}

    def describe(self, key: ChunkKey, info: ChunkInfo) -> None:
        if key not in self._info:
            self._info[key] = info

    def holders(self, key: ChunkKey) -> set[str]:
        return set(self._holders.get(key, ()))

    def stored(self, key: ChunkKey, tier: str) -> None:
        info = self._info.get(key)
        if info is None:
            return  # a chunk this process never described (another engine's): not ours to publish
        held = self._holders.setdefault(key, set())
        if tier in held:
            return
        medium = self._medium[tier]
        first = not any(self._medium[t] == medium for t in held)
        held.add(tier)
        if first:
            self._events.append(BlockStored(
                block_hashes=list(info.block_hashes), parent_block_hash=info.parent,
                token_ids=info.tokens.tolist(), block_size=self.block_size, medium=medium,
            ))

    def removed(self, key: ChunkKey, tier: str) -> None:
        held = self._holders.get(key)
        if not held or tier not in held:
            return
        held.discard(tier)
        medium = self._medium[tier]
        if not any(self._medium[t] == medium for t in held):
            self._events.append(BlockRemoved(block_hashes=list(self._info[key].block_hashes), medium=medium))
        if not held:
            del self._holders[key]
            del self._info[key]

    def sweep(self, tier: str, still_has: Callable[[ChunkKey], bool | None]) -> None:
        """Publish removals for the keys ``tier`` no longer holds (``still_has(key)`` False)."""
        gone = [k for k, held in self._holders.items() if tier in held and still_has(k) is False]
        for k in gone:
            self.removed(k, tier)

    def sweep_evicted(self, tier: str, evictions: int, still_has: Callable[[ChunkKey], bool | None]) -> None:
        """If ``tier`` evicted anything since the last call (its eviction
        counter moved), publish what it dropped."""
        if evictions != self._evictions.get(tier, 0):
            self._evictions[tier] = evictions
            self.sweep(tier, still_has)

    def forget(self, key: ChunkKey) -> None:
        """Drop a description no tier took (a save that never happened)."""
        if key not in self._holders:
            self._info.pop(key, None)

    def snapshot(self) -> list[AnyKVCacheEvent]:
        """What each medium holds now, one BlockStored per chunk and medium
        (for a router that lost the stream; the pending events are already
        reflected)."""
        out: list[AnyKVCacheEvent] = []
        for key, held in self._holders.items():
            info = self._info[key]
            for medium in sorted({self._medium[t] for t in held}):
                out.append(BlockStored(block_hashes=list(info.block_hashes), parent_block_hash=info.parent,
                                       token_ids=[], block_size=self.block_size, medium=medium))
        return out

    def take(self) -> list[AnyKVCacheEvent]:
        events, self._events = self._events, []
        return events


class ObservedTier:
    """A lower tier, forwarded unchanged, that tells the recorder when a copy
    appears or disappears. Owns nothing."""

    def __init__(self, tier: LowerTier, recorder: TierEventRecorder) -> None:
        self._tier = tier
        self._rec = recorder
        recorder.sweep_evicted(tier.name, tier.counters.evictions, tier.has)  # the count so far: nothing to sweep
        self.name, self.kind, self.write_back = tier.name, tier.kind, tier.write_back
        self.counters = tier.counters

    def __getattr__(self, name: str) -> Any:  # Any: the tier's own start, drain, aclose, stats, pin, ...
        return getattr(self._tier, name)

    @classmethod
    def from_spec(cls, spec: TierSpec, prefix: str) -> LowerTier:
        raise TypeError("ObservedTier wraps a built tier; build the tier first")

    @property
    def available(self) -> bool:
        return self._tier.available

    @property
    def pending(self) -> int:
        return self._tier.pending

    def has(self, key: ChunkKey) -> bool | None:
        return self._tier.has(key)

    async def metas(self, keys: Sequence[ChunkKey]) -> list[ObjectMeta | None]:
        found = await self._tier.metas(keys)
        if self._tier.available:
            for k, m in zip(keys, found, strict=True):
                if m is None:
                    self._rec.removed(k, self.name)
        return found

    def submit_put(self, key: ChunkKey, obj: MemoryObj) -> asyncio.Future[bool] | None:
        fut = self._tier.submit_put(key, obj)
        if fut is not None:
            fut.add_done_callback(lambda f: _ok(f) and self._rec.stored(key, self.name))
        self._check_evictions()
        return fut

    def submit_read(self, key: ChunkKey, meta: ObjectMeta, dst: MemoryObj) -> asyncio.Future[bool] | None:
        fut = self._tier.submit_read(key, meta, dst)
        if fut is not None:
            fut.add_done_callback(lambda f: _ok(f) or self._read_failed(key))
        return fut

    def submit_remove(self, key: ChunkKey) -> bool:
        done = self._tier.submit_remove(key)
        if done:
            self._rec.removed(key, self.name)
        return done

    def _read_failed(self, key: ChunkKey) -> None:
        has = self._tier.has(key)
        if has is False or (has is None and self._tier.available):
            self._rec.removed(key, self.name)

    def _check_evictions(self) -> None:
        self._rec.sweep_evicted(self.name, self._tier.counters.evictions, self._tier.has)


def _ok(fut: asyncio.Future[bool]) -> bool:
    return not fut.cancelled() and fut.exception() is None and fut.result() is not False
