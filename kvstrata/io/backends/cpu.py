"""L1: objects in host memory (pinned on CUDA hosts).

Allocation is the evict-and-retry loop: try the allocator; if it has no room,
evict the policy's first evictable victim and try again, until it fits or
nothing is left to evict (then None: the caller skips the store, it never
waits for room). An evicted object whose memory is still held (a write-back
or write-through job, a reader) frees its bytes later; the loop stops once
that pending memory would cover the request, rather than evicting more.

Layerwise keys (``layer >= 0``) of one chunk are evicted together: when one
layer is chosen as a victim, its evictable sibling layers go with it, since a
chunk missing a layer cannot be loaded.

An entry is *in flight* from ``put(..., ready=fut)`` (or ``begin_fill``)
until ``fut`` completes: it counts as present, cannot be evicted, and a reader
waits for it. If the store fails, the entry is removed and waiters miss.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

import torch

from kvstrata.io.allocators import Allocator, make_allocator
from kvstrata.io.config import CPUConfig
from kvstrata.io.keys import ChunkKey
from kvstrata.io.memory import MemoryObj, object_nbytes, release_all
from kvstrata.io.policies import make_policy
from kvstrata.io.stats import TierCounters, TierStats

EvictHook = Callable[[ChunkKey, MemoryObj], None]


class CPUTier:
    """Owns: the allocator, the key -> object index (one reference each),
    the policy, the futures of in-flight entries, and the layer keys of each
    chunk. Loop-owned."""

    kind = "cpu"

    def __init__(self, cfg: CPUConfig, *, on_evict: EvictHook | None = None, name: str = "cpu") -> None:
        cfg.validate("cpu")
        self.name = name
        self.allocator: Allocator = make_allocator(cfg)
        self._policy_name = cfg.policy
        self.policy = make_policy(cfg.policy)
        self.counters = TierCounters()
        self._index: dict[ChunkKey, MemoryObj] = {}
        self._inflight: dict[ChunkKey, asyncio.Future] = {}
        self._layers: dict[tuple[str, bytes], set[ChunkKey]] = {}
        self._on_evict = on_evict

    # --- allocation ----------------------------------------------------
    def allocate(self, shape: Sequence[int], dtype: torch.dtype, layout: str = "raw") -> MemoryObj | None:
        nbytes = object_nbytes(shape, dtype)
        alloc = self.allocator
        return self._with_room(lambda: alloc.allocate(shape, dtype, layout), nbytes)

    def batched_allocate(
        self, n: int, shape: Sequence[int], dtype: torch.dtype, layout: str = "raw"
    ) -> list[MemoryObj] | None:
        """n objects, in one region when possible; all or nothing."""
        objs = self.allocator.batched_allocate(n, shape, dtype, layout)
        if objs is not None:
            return objs
        objs = []
        for _ in range(n):
            obj = self.allocate(shape, dtype, layout)
            if obj is None:
                release_all(objs)
                return None
            objs.append(obj)
        return objs

    def _with_room(self, attempt: Callable[[], MemoryObj | None], nbytes: int) -> MemoryObj | None:
        if not self.allocator.can_ever_fit(nbytes):
            return None
        pending = 0
        while True:
            obj = attempt()
            if obj is not None:
                return obj
            victims = self.policy.victims(1, self._evictable)
            if not victims:
                return None
            for victim in self._evict(victims[0]):
                if victim.ref_count > 0:  # someone still holds the bytes; they free later
                    pending += victim.alloc_size
            if pending >= nbytes:
                return None

    def _evictable(self, key: ChunkKey) -> bool:
        return self._index[key].can_evict and key not in self._inflight

    def _evict(self, key: ChunkKey) -> list[MemoryObj]:
        """Evict ``key`` and, for a layer key, its evictable sibling layers."""
        keys = [key]
        if key.layer >= 0:
            keys += [k for k in self._layers[(key.identity, key.prefix_hash)]
                     if k != key and self._evictable(k)]
        out = []
        for k in keys:
            obj = self._drop(k)
            self.counters.evictions += 1
            if self._on_evict is not None:
                self._on_evict(k, obj)
            obj.release()
            out.append(obj)
        return out

    def _drop(self, key: ChunkKey) -> MemoryObj:
        """Unindex ``key``; the caller releases the tier's reference."""
        obj = self._index.pop(key)
        self.policy.on_remove(key)
        if key.layer >= 0:
            chunk = (key.identity, key.prefix_hash)
            layers = self._layers[chunk]
            layers.discard(key)
            if not layers:
                del self._layers[chunk]
        return obj

    # --- index ---------------------------------------------------------
    def put(self, key: ChunkKey, obj: MemoryObj, ready: Awaitable | None = None) -> bool:
        """Index ``obj`` under ``key`` (the tier takes its own reference).
        With ``ready``, the entry is in flight until it completes. False if
        the key is already present (same key, same bytes: nothing to do)."""
        if key in self._index:
            return False
        obj.ref_up()
        self._index[key] = obj
        self.policy.on_put(key)
        if key.layer >= 0:
            self._layers.setdefault((key.identity, key.prefix_hash), set()).add(key)
        self.counters.puts += 1
        self.counters.bytes_in += obj.nbytes
        if ready is not None:
            fut = asyncio.ensure_future(ready)
            self._inflight[key] = fut
            fut.add_done_callback(partial(self._settle, key))
        return True

    def begin_fill(self, key: ChunkKey, obj: MemoryObj) -> asyncio.Future:
        """Index ``obj`` in flight; the returned future's result (True/False)
        says whether the filler succeeded."""
        fut = asyncio.get_running_loop().create_future()
        self.put(key, obj, fut)
        return fut

    def _settle(self, key: ChunkKey, fut: asyncio.Future) -> None:
        if self._inflight.get(key) is fut:
            del self._inflight[key]
        if not _succeeded(fut) and key in self._index:
            self._drop(key).release()

    def contains(self, key: ChunkKey) -> bool:
        return key in self._index

    def in_flight(self, key: ChunkKey) -> asyncio.Future | None:
        return self._inflight.get(key)

    def take(self, key: ChunkKey) -> MemoryObj | None:
        """The object (ready or in flight) with a reference for the caller."""
        obj = self._index.get(key)
        if obj is not None:
            obj.ref_up()
        return obj

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Count hits, suffix first, so a prefix's first chunk ends up the
        most recently used (a shared prefix outlives its tails)."""
        on_hit = self.policy.on_hit
        for key in reversed(keys):
            on_hit(key)

    async def wait_ready(self, key: ChunkKey) -> bool:
        """Wait for an in-flight entry; True if it is (now) present.
        Cancelling the waiter never cancels the store it waits for."""
        fut = self._inflight.get(key)
        if fut is not None:
            await asyncio.wait({fut})
        return key in self._index

    def remove(self, key: ChunkKey) -> bool:
        obj = self._index.get(key)
        if obj is None or obj.pin_count or key in self._inflight:
            return False
        self._drop(key).release()
        return True

    def pin(self, key: ChunkKey) -> bool:
        obj = self._index.get(key)
        if obj is None:
            return False
        obj.pin()
        return True

    def unpin(self, key: ChunkKey) -> None:
        obj = self._index.get(key)
        if obj is not None and obj.pin_count:
            obj.unpin()

    # --- lifecycle and stats -----------------------------------------
    def objects(self) -> list[MemoryObj]:
        return list(self._index.values())

    def pinned_count(self) -> int:
        return sum(1 for o in self._index.values() if o.pin_count)

    def clear(self) -> None:
        """Drop the tier's reference to everything (close)."""
        objs = list(self._index.values())
        self._index.clear()
        self._inflight.clear()
        self._layers.clear()
        self.policy = make_policy(self._policy_name)
        release_all(objs)

    def stats(self) -> TierStats:
        a = self.allocator
        return self.counters.snapshot(
            self.name, self.kind, available=True, usage_bytes=a.used_bytes,
            capacity_bytes=a.capacity, num_objects=len(self._index),
        )


def _succeeded(fut: asyncio.Future) -> bool:
    if fut.cancelled():
        return False
    if fut.exception() is not None:
        return False
    return fut.result() is not False
