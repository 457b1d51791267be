"""StorageManager: the tiered KV store's one entry point. Every read,
lookup and pin goes through it.

    put(key, obj)    L1 at once; each write-through tier asynchronously now,
                     each write-back tier when L1 evicts the object
    lookup(keys)     how many leading chunks some tier has (one contiguous
                     prefix across tiers)
    locate(keys)     the same, as the source of each of those chunks
    get(keys)        the leading chunks, each from the fastest tier that has
                     it; lower-tier chunks are read into L1 (promoted)

Without I/O, for a caller that must not wait (the connector's scheduler side)::

    probe(keys)      sources of the leading chunks the tiers know of without
                     I/O, and whether that answer is definite
    take_ready(keys) references to the leading chunks ready in memory now
    pin(keys, srcs)  pins in those sources (from ``probe`` or ``locate``);
                     ``release_pins(pins)`` undoes them. The one way to pin
    holds(key)       some tier is known to have it

A *source* is where a chunk is: ``L1_SOURCE`` (0) is L1, ``i + 1`` is
``tiers[i]`` (``kvstrata.io.sources``). A save::

    obj = store.allocate(shape, dtype, layout)        # None: skip this chunk
    ...fill obj.tensor...
    store.put(key, obj); obj.release()                # the store keeps its own ref

No tier fault reaches the caller: an unusable tier only costs misses and
dropped puts. Every read from a lower tier is checksum-verified by the tier.
All methods are called on the event loop that started the store (``put``
and ``allocate`` are synchronous but queue I/O on that loop). One ``get``
returns at most what L1 can hold at once: ask in batches smaller than L1.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

import structlog
import torch

from kvstrata.io.backends.base import LowerTier, ObjectMeta
from kvstrata.io.backends.cpu import CPUTier, _succeeded
from kvstrata.io.config import StoreConfig
from kvstrata.io.keys import ChunkKey, ChunkKeyer, StoreIdentity
from kvstrata.io.memory import MemoryObj, dtype_from_name, release_all
from kvstrata.io.rates import ReadRate, ReadThrottle
from kvstrata.io.registry import TierRegistry
from kvstrata.io.sources import L1_SOURCE, LOCAL_KINDS, Pin, Sources, aguard, guard, submit_put
from kvstrata.io.stats import Outstanding, StoreStats

log = structlog.get_logger(__name__)


class StorageManager:
    """Owns: the L1 tier, the lower tiers (fastest first), the objects L1
    evicted that are still being written back, the lookup counters and the
    write listener. Loop-owned; no locks. (Pins taken by ``pin`` belong to
    the caller, who hands them back to ``release_pins``.)"""

    def __init__(self, config: StoreConfig, *, registry: TierRegistry | None = None,
                 tiers: Sequence[LowerTier] | None = None) -> None:
        config.validate()
        self.config = config
        self.l1 = CPUTier(config.cpu, on_evict=self._on_l1_evict)
        if tiers is None:
            registry = registry or TierRegistry()
            tiers = [registry.build(spec, f"tiers[{i}]") for i, spec in enumerate(config.tiers)]
        self.tiers: list[LowerTier] = list(tiers)
        self._through = [t for t in self.tiers if not t.write_back]
        self._back = [t for t in self.tiers if t.write_back]
        self._through_shared = [t for t in self._through if t.kind not in LOCAL_KINDS]
        self._through_local = [t for t in self._through if t.kind in LOCAL_KINDS]
        self._l1_only: set[ChunkKey] = set()  # put with lower=False, still in L1
        self._flushing: dict[ChunkKey, MemoryObj] = {}
        self._sources = Sources(self.l1, self.tiers, self._flushing)
        # Per lower tier (index = source - 1): measured reads, and the cap its spec sets.
        self._rates = [ReadRate() for _ in self.tiers]
        caps = ([spec.read_bandwidth_bps for spec in config.tiers] if len(config.tiers) == len(self.tiers)
                else [None] * len(self.tiers))  # tiers handed in ready-made: no caps
        self._throttles = [ReadThrottle(c) if c else None for c in caps]
        self._lookups = self._lookup_chunks = self._lookup_hits = 0
        self._on_write: Callable[[], None] | None = None
        self._closed = False

    @classmethod
    async def open(cls, config: StoreConfig, **kw) -> StorageManager:
        store = cls(config, **kw)
        await store.start()
        return store

    async def start(self) -> None:
        """Start the lower tiers; one that cannot reach its medium starts
        unavailable rather than failing the store."""
        try:
            for t in self.tiers:
                await t.start()
        except BaseException:
            await self.aclose()
            raise

    async def __aenter__(self) -> StorageManager:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def keyer(self, identity: StoreIdentity) -> ChunkKeyer:
        return ChunkKeyer(identity, save_partial=self.config.save_partial_chunks)

    def set_write_listener(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` (on the loop) whenever a lower-tier write ends,
        written or not; None: no listener."""
        self._on_write = callback

    # --- sources -------------------------------------------------------
    @property
    def tier_names(self) -> list[str]:
        """Tier names by source: L1's first."""
        return self._sources.names

    def source_name(self, src: int) -> str:
        return self._sources.name(src)

    def is_local(self, src: int) -> bool:
        """L1 or a local tier (a read of short, known latency)."""
        return self._sources.is_local(src)

    # --- store ---------------------------------------------------------
    def allocate(self, shape: Sequence[int], dtype: torch.dtype, layout: str = "raw") -> MemoryObj | None:
        """Room in L1 (evicting as needed); None if there is none now."""
        return self.l1.allocate(shape, dtype, layout)

    def batched_allocate(self, n: int, shape: Sequence[int], dtype: torch.dtype,
                         layout: str = "raw") -> list[MemoryObj] | None:
        return self.l1.batched_allocate(n, shape, dtype, layout)

    def put(self, key: ChunkKey, obj: MemoryObj, *, ready: Awaitable | None = None, lower: bool = True) -> bool:
        """Store ``obj`` under ``key``; never waits. ``ready`` (e.g. a future
        set when a device-to-host copy completes) keeps the entry in flight
        until done: readers wait for it, lower tiers are written after it.
        ``lower=False`` keeps it off the local lower tiers (disk: no
        write-through now, no write-back when evicted), a chunk not yet worth
        their I/O; shared tiers (Redis, a shared filesystem) still get it,
        for other engines. The caller keeps its own reference. False if
        already stored."""
        if self._closed or not self.l1.put(key, obj, ready):
            return False
        if lower:
            self._l1_only.discard(key)
        else:
            self._l1_only.add(key)
        self._write_through(key, obj, self._through if lower else self._through_shared)
        return True

    def batched_put(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> int:
        if len(keys) != len(objs):
            raise ValueError(f"keys and objs differ in length ({len(keys)} != {len(objs)})")
        return sum(self.put(k, o) for k, o in zip(keys, objs))

    def _write_through(self, key: ChunkKey, obj: MemoryObj, tiers: list[LowerTier]) -> None:
        """Write ``obj`` to ``tiers`` now, or once its L1 entry is filled."""
        if not tiers:
            return
        fut = self.l1.in_flight(key)
        if fut is None:
            self._submit_puts(key, obj, tiers)
        else:
            fut.add_done_callback(lambda f: _succeeded(f) and self._submit_puts(key, obj, tiers))

    def _submit_puts(self, key: ChunkKey, obj: MemoryObj, tiers: list[LowerTier]) -> None:
        if self._closed or obj.ref_count == 0:
            return
        for t in tiers:
            self._watch(submit_put(t, key, obj))

    def _watch(self, write: asyncio.Future | None) -> asyncio.Future | None:
        if write is not None and self._on_write is not None:
            write.add_done_callback(self._wrote)
        return write

    def _wrote(self, _write: asyncio.Future) -> None:
        listener = self._on_write
        if listener is None:
            return
        try:
            listener()
        except Exception:  # the listener's fault must not break the store's bookkeeping
            log.exception("store_write_listener_failed")

    def _on_l1_evict(self, key: ChunkKey, obj: MemoryObj) -> None:
        """Write-back: hand the evicted object to the write-back tiers; it
        stays readable here until they are done."""
        back = self._back
        if key in self._l1_only:
            self._l1_only.discard(key)
            back = [t for t in back if t.kind not in LOCAL_KINDS]
        if not back or self._closed:
            return
        futs = [f for t in back if (f := self._watch(submit_put(t, key, obj))) is not None]
        if not futs:
            return
        obj.ref_up()
        self._flushing[key] = obj
        left = [len(futs)]

        def done(_f: asyncio.Future) -> None:
            left[0] -= 1
            if left[0] == 0:
                if self._flushing.get(key) is obj:
                    del self._flushing[key]
                obj.release()

        for f in futs:
            f.add_done_callback(done)

    # --- lookup --------------------------------------------------------
    async def lookup(self, keys: Sequence[ChunkKey]) -> int:
        """Number of leading ``keys`` that some tier holds. To keep them,
        ``pin(keys, await locate(keys))``."""
        return len(await self.locate(keys))

    async def locate(self, keys: Sequence[ChunkKey]) -> list[int]:
        """The source of each leading key some tier holds (as many as
        ``lookup`` counts); counted as a lookup."""
        self._lookups += 1
        self._lookup_chunks += len(keys)
        if self._closed or not keys:
            return []
        n, src, _ = await self._locate(keys)
        self._lookup_hits += n
        return src[:n]

    async def _locate(self, keys: Sequence[ChunkKey]) -> tuple[int, list[int], list[ObjectMeta | None]]:
        """(leading count, source per key, lower-tier meta per key)."""
        src = [-1] * len(keys)
        metas: list[ObjectMeta | None] = [None] * len(keys)
        l1, flushing = self.l1, self._flushing
        missing = []
        for i, k in enumerate(keys):
            if l1.contains(k) or k in flushing:
                src[i] = L1_SOURCE
            else:
                missing.append(i)
        for ti, tier in enumerate(self.tiers):
            if not missing:
                break
            asked = [keys[i] for i in missing]
            found = await aguard(tier, "metas", tier.metas(asked), [None] * len(asked))
            rest = []
            for i, m in zip(missing, found):
                if m is None:
                    rest.append(i)
                else:
                    src[i], metas[i] = ti + 1, m
            missing = rest
        n = missing[0] if missing else len(keys)
        return n, src, metas

    # --- without I/O ---------------------------------------------------
    def probe(self, keys: Sequence[ChunkKey]) -> tuple[list[int], bool]:
        """(source of each leading key known without I/O, whether that answer
        is definite). Stops at the first key no tier has (definite) or the
        first only I/O can settle (a tier that cannot tell without asking:
        not definite; ``locate`` then answers). A chunk still being filled
        into L1 is not ready there: it counts where a lower tier has it."""
        return self._sources.probe(keys)

    def holds(self, key: ChunkKey) -> bool:
        """Known without I/O to be stored: in L1 (even in flight) or in an
        available lower tier that says so."""
        return self._sources.holds(key)

    def in_l1(self, key: ChunkKey) -> bool:
        """In L1's index (ready or in flight)."""
        return self.l1.contains(key)

    @property
    def l1_evictions(self) -> int:
        return self.l1.counters.evictions

    def take_ready(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        """References to the leading ``keys`` ready in memory now (stops at the
        first that is not): a synchronous hit, nothing to wait for. Like a
        pin, a reference keeps the bytes from eviction; ``release()`` each.
        Neither counted as a hit nor refreshed in the eviction order."""
        objs = self._sources.take_ready(keys)
        if self._l1_only:
            for key, obj in zip(keys, objs):
                self._proven(key, obj)
        return objs

    def _proven(self, key: ChunkKey, obj: MemoryObj) -> None:
        """A chunk kept off the local tiers (``put(lower=False)``) was read:
        it is worth their I/O now."""
        if key in self._l1_only:
            self._l1_only.discard(key)
            self._write_through(key, obj, self._through_local)

    def pin(self, keys: Sequence[ChunkKey], srcs: Sequence[int]) -> list[Pin]:
        """Pin each key in the source that ``srcs`` names (as ``probe`` or
        ``locate`` answered), where that tier can pin; returns the pins taken,
        to hand back to ``release_pins``. The store's only pin: the caller
        owns its pins, so two callers' pins never mix."""
        return [(key, src) for key, src in zip(keys, srcs, strict=True) if self._sources.pin(key, src)]

    def release_pins(self, pins: Sequence[Pin]) -> None:
        """Undo pins taken by ``pin``."""
        for key, src in pins:
            self._sources.unpin(key, src)

    # --- get -----------------------------------------------------------
    async def get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        """The leading chunks available, in order, each with a reference for
        the caller (``release()`` each when done). Stops at the first chunk
        no tier can deliver (absent, corrupt, unreachable, no room in L1)."""
        if self._closed or not keys:
            return []
        n, src, metas = await self._locate(keys)
        # Synchronous from here to the first await: L1 cannot change under us.
        # Reference every L1 hit first, so promotions cannot evict them.
        objs: list[MemoryObj | None] = [None] * n
        waits: list[asyncio.Future | None] = [None] * n
        take, in_flight = self.l1.take, self.l1.in_flight
        for i in range(n):
            obj = take(keys[i]) or self._sources.take(keys[i])  # L1, else held for a write-back
            if obj is not None:
                src[i], objs[i], waits[i] = L1_SOURCE, obj, in_flight(keys[i])
                if self._l1_only:
                    self._proven(keys[i], obj)
        stop = n
        batch: dict[int, list[float]] = {}  # source -> [bytes read, when its last read ended]
        t0 = time.perf_counter()
        for i in range(n):
            if objs[i] is None:
                filled = self._promote(keys[i], src[i], metas[i], batch) if src[i] > L1_SOURCE else None
                if filled is None:
                    stop = i
                    break
                objs[i], waits[i] = filled
        release_all([o for o in objs[stop:] if o is not None])
        got: list[MemoryObj] = objs[:stop]  # type: ignore[assignment]  # no None before stop
        served = stop
        try:
            for i, w in enumerate(waits[:stop]):
                if w is not None:
                    await asyncio.wait({w})
                    if not _succeeded(w):
                        served = i
                        break
        except BaseException:
            release_all(got)
            raise
        release_all(got[served:])
        for s, (nbytes, end) in batch.items():
            if nbytes:
                self._rates[s - 1].observe_batch(end - t0, int(nbytes))
        self._sources.count(keys, src, served)
        self.l1.touch(keys[:served])
        return got[:served]

    def _promote(self, key: ChunkKey, src: int, meta: ObjectMeta | None,
                 batch: dict[int, list[float]]) -> tuple[MemoryObj, asyncio.Future] | None:
        """Allocate in L1, index it in flight, and read the tier into it
        (held until its turn ends on a capped tier); the read is measured,
        and added to ``batch`` when it delivers."""
        tier = self._sources.tier(src)
        try:
            assert meta is not None
            obj = self.l1.allocate(meta.shape, dtype_from_name(meta.dtype), meta.layout)
        except (ValueError, TypeError) as e:  # a tier handed back nonsense metadata
            log.warning("bad_object_meta", tier=tier.name, key=key.name, error=str(e))
            return None
        if obj is None:
            return None
        fill = self.l1.begin_fill(key, obj)
        read = guard(tier, "submit_read", lambda: tier.submit_read(key, meta, obj), None)
        if read is None:
            fill.set_result(False)
            obj.release()
            return None
        rate, throttle, t_start = self._rates[src - 1], self._throttles[src - 1], time.perf_counter()
        turn_end = throttle.reserve(obj.nbytes, t_start) if throttle is not None else 0.0

        def finish(ok: bool) -> None:
            if fill.done():
                return
            end = time.perf_counter()
            rate.observe_read(end - t_start, obj.nbytes, ok)
            if ok:
                acc = batch.setdefault(src, [0, 0.0])
                acc[0] += obj.nbytes
                acc[1] = max(acc[1], end)
            fill.set_result(ok)

        def read_done(r: asyncio.Future) -> None:
            ok = _succeeded(r)
            wait = turn_end - time.perf_counter()
            if ok and wait > 0:
                asyncio.get_running_loop().call_later(wait, finish, ok)
            else:
                finish(ok)

        read.add_done_callback(read_done)
        return obj, fill

    @property
    def has_shared_tiers(self) -> bool:
        """Some lower tier is shared with other engines (Redis, a shared filesystem)."""
        return any(t.kind not in LOCAL_KINDS for t in self.tiers)

    def read_rates(self) -> dict[str, ReadRate]:
        """Each lower tier's measured reads, by tier name."""
        return {t.name: r for t, r in zip(self.tiers, self._rates, strict=True)}

    # --- maintenance ---------------------------------------------------
    def remove(self, key: ChunkKey) -> None:
        """Forget ``key`` everywhere it is not pinned or in use."""
        self.l1.remove(key)
        self._l1_only.discard(key)
        for t in self.tiers:
            guard(t, "submit_remove", partial(t.submit_remove, key), False)

    async def drain(self) -> None:
        """Wait until no tier has queued or running I/O."""
        while any(t.pending for t in self.tiers):
            await asyncio.gather(*(t.drain() for t in self.tiers))

    def stats(self) -> StoreStats:
        return StoreStats(
            tiers=(self.l1.stats(), *(t.stats() for t in self.tiers)),
            lookups=self._lookups, lookup_chunks=self._lookup_chunks,
            lookup_hit_chunks=self._lookup_hits,
        )

    def outstanding(self) -> Outstanding:
        """Pins, references beyond the tiers' own, and pending I/O."""
        held = {id(o) for o in self.l1.objects()}
        referenced = sum(o.ref_count - (id(o) in held) for o in self.l1.allocator.live_objects())
        return Outstanding(
            pinned=self.l1.pinned_count() + sum(t.pinned_count() for t in self.tiers),
            referenced=referenced,
            pending_jobs=sum(t.pending for t in self.tiers),
        )

    async def aclose(self) -> None:
        """Finish queued writes (bounded by ``close_timeout_s``), close the
        tiers, drop L1. Idempotent."""
        if self._closed:
            return
        try:
            async with asyncio.timeout(self.config.close_timeout_s):
                await self.drain()
        except TimeoutError:
            log.warning("store_close_timeout", pending=sum(t.pending for t in self.tiers))
        finally:
            self._closed = True
            for t in self.tiers:
                await aguard(t, "aclose", t.aclose(), None)
            self._l1_only.clear()
            self.l1.clear()

    def l1_victim(self, nbytes: int) -> ChunkKey | None:
        """The key L1 would evict first to make room for ``nbytes`` now; None
        when the bytes fit without evicting, or nothing is evictable. Read
        only (an admission policy compares it with what it would admit)."""
        l1 = self.l1
        if l1.allocator.capacity - l1.allocator.used_bytes >= nbytes:
            return None
        victims = l1.policy.victims(1, l1._evictable)
        return victims[0] if victims else None
