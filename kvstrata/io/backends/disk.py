"""L2: local disk, one file per object (format in ``fileformat``).

The index (key -> size, shape, pins, readers) lives in memory and is rebuilt
from the directory at start, so the tier survives a restart. Capacity is
enforced at submit time: bytes used + bytes reserved by writes in flight never
exceed ``capacity_bytes``; the policy picks victims among entries that are not
pinned and not being read. All file I/O runs on the tier's bounded thread
pool, scheduled by its priority executor.

An evicted object's file is unlinked by a DELETE job; a put writes only
after every unlink submitted before it has landed, so the room an eviction
made is on the filesystem, not only in the count, when the put needs it::

    submit_put: evict v (index and count now) -> DELETE(v) -> PUT(k)
    PUT(k) job: wait for DELETE(v) (running or done: it outranks puts) -> write

A full filesystem (ENOSPC, EDQUOT) is not a fault: the disk holds less than
``capacity_bytes``, so the capacity is lowered to the bytes of ours on it
and the policy evicts to make room, as it does at capacity; the put that
hit the wall is dropped and later ones land. While lowered, every landed
put or unlink asks the filesystem how much room it has (statvfs) and the
capacity rises again to what fits, up to ``capacity_bytes``: a full disk
costs capacity only while it stays full. Faults (EACCES/EPERM, EROFS, EIO,
the directory gone) make the tier unavailable (see ``Health``): reads miss,
puts drop, until a retry succeeds. A single missing file is just a miss; a
corrupt one is a miss, counted, logged and deleted.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import structlog

from kvstrata.io.backends.base import Health, ObjectMeta
from kvstrata.io.backends.fileformat import ObjectFiles, ReadStatus
from kvstrata.io.config import DiskOptions, TierSpec, decode_options
from kvstrata.io.executors import Priority, PriorityExecutor, run_in_thread
from kvstrata.io.keys import ChunkKey
from kvstrata.io.memory import ALIGN, MemoryObj, dtype_name
from kvstrata.io.policies import make_policy
from kvstrata.io.stats import TierCounters, TierStats

log = structlog.get_logger(__name__)
_FULL = (errno.ENOSPC, errno.EDQUOT)


class _Entry:
    __slots__ = ("meta", "size", "pins", "readers")

    def __init__(self, meta: ObjectMeta, size: int) -> None:
        self.meta = meta
        self.size = size
        self.pins = 0
        self.readers = 0


class DiskTier:
    """Owns: the index, the policy, the used/reserved byte counts, the keys
    being written, the files being unlinked (key -> bytes, DELETE job), the
    capacity now (at most the configured one), the executor, the thread pool
    and the health state. Loop-owned; threads only run ``ObjectFiles`` calls."""

    kind = "disk"

    def __init__(self, opts: DiskOptions, *, name: str = "disk", write_back: bool = False) -> None:
        opts.validate(name)
        self.name = name
        self.write_back = write_back
        self.capacity = opts.capacity_bytes
        self.counters = TierCounters()
        self.files = ObjectFiles(opts.path, use_odirect=opts.use_odirect, fsync=opts.fsync)
        self.policy = make_policy(opts.policy)
        self._opts = opts
        self._health = Health(name, opts.health)
        self._index: dict[ChunkKey, _Entry] = {}
        self._writing: dict[ChunkKey, int] = {}
        self._deleting: dict[ChunkKey, tuple[int, asyncio.Future | None]] = {}
        self._used = 0
        self._reserved = 0
        self._pool: ThreadPoolExecutor | None = None
        self._exec = PriorityExecutor(name, max_in_flight=opts.io_threads,
                                      max_queued_puts=opts.max_queued_puts)
        self._closed = False

    @classmethod
    def from_spec(cls, spec: TierSpec, prefix: str) -> DiskTier:
        opts = decode_options(spec.options, DiskOptions, f"{prefix}.options")
        return cls(opts, name=spec.name or spec.type, write_back=spec.write == "back")

    async def start(self) -> None:
        """Rebuild the index from the directory (an unreadable directory
        leaves the tier unavailable, it does not raise)."""
        self._pool = ThreadPoolExecutor(self._opts.io_threads, thread_name_prefix=f"kvstrata-{self.name}")
        try:
            entries, bad = await run_in_thread(self._pool, self.files.scan)
        except OSError as e:
            self.counters.faults += 1
            self._health.fault(e)
            return
        for h, _mtime in entries:
            m = h.meta
            self._add(m.key, _Entry(ObjectMeta(m.shape, m.dtype, m.layout, h.payload_len), h.file_size))
        self.counters.corrupt += bad
        self._make_room(0)  # capacity may have shrunk since the last run
        log.info("disk_tier_started", tier=self.name, objects=len(self._index), bytes=self._used,
                 removed_bad=bad)

    # --- queries -------------------------------------------------------
    @property
    def available(self) -> bool:
        return self._health.available

    @property
    def pending(self) -> int:
        return self._exec.pending

    def has(self, key: ChunkKey) -> bool | None:
        return key in self._index

    async def metas(self, keys: Sequence[ChunkKey]) -> list[ObjectMeta | None]:
        if not self._health.allow():
            return [None] * len(keys)
        index = self._index
        return [e.meta if (e := index.get(k)) is not None else None for k in keys]

    # --- put -----------------------------------------------------------
    def submit_put(self, key: ChunkKey, obj: MemoryObj) -> asyncio.Future | None:
        if key in self._index or key in self._writing or key in self._deleting or self._closed:
            return None
        size = ALIGN + obj.nbytes  # header page + payload; corrected when written
        if not self._health.allow() or not self._make_room(size):
            self.counters.dropped_puts += 1
            return None
        self._writing[key] = size
        self._reserved += size
        obj.ref_up()
        unlinks = [f for _, f in self._deleting.values() if f is not None]
        return self._exec.submit(Priority.PUT, self._put_job, key, obj, size, unlinks,
                                 on_drop=partial(self._unreserve, key, obj, size))

    def _unreserve(self, key: ChunkKey, obj: MemoryObj, size: int) -> None:
        del self._writing[key]
        self._reserved -= size
        obj.release()

    async def _put_job(self, key: ChunkKey, obj: MemoryObj, size: int, unlinks: list[asyncio.Future]) -> bool:
        """Write after ``unlinks`` (the DELETE jobs submitted before this put,
        which the room counted for it may depend on) have landed. They
        outrank puts in the executor, so they are running or done by now:
        waiting cannot hold up their own start."""
        assert self._pool is not None
        full = False
        try:
            if unlinks:
                await asyncio.wait(unlinks)
            written = await run_in_thread(self._pool, self.files.write, key, obj.numpy_bytes(),
                                          obj.shape, dtype_name(obj.dtype), obj.layout)
        except OSError as e:
            self.counters.dropped_puts += 1
            full = e.errno in _FULL
            if not full:
                self.counters.faults += 1
                self._health.fault(e)
            return False
        finally:
            self._unreserve(key, obj, size)
            if full:
                self._medium_full(size)
        self._health.ok()
        self._add(key, _Entry(ObjectMeta(obj.shape, dtype_name(obj.dtype), obj.layout, obj.nbytes), written))
        self.counters.puts += 1
        self.counters.bytes_in += obj.nbytes
        if self._used > self.capacity:  # header larger than estimated (never with this format)
            self._make_room(0)
        await self._regrow()
        return True

    def _on_medium(self) -> int:
        """Bytes of ours on the filesystem or about to be: the index, the
        writes in flight, the files not yet unlinked."""
        return self._used + self._reserved + sum(n for n, _ in self._deleting.values())

    def _medium_full(self, size: int) -> None:
        """The filesystem ran out of room before our capacity did: what we
        hold there now is what fits. Lower the capacity to it and evict (by
        policy) room for one more object of ``size`` bytes."""
        new_capacity = max(size, self._on_medium())
        if new_capacity < self.capacity:
            log.warning("disk_tier_full", tier=self.name, capacity_bytes=self.capacity,
                        new_capacity_bytes=new_capacity, used_bytes=self._used)
            self.capacity = new_capacity
        self._make_room(size)

    async def _regrow(self) -> None:
        """A lowered capacity rises to what fits now (ours on the filesystem
        plus its free room), up to the configured one. Writes in flight are
        not yet in the free room nor counted here: never an overestimate."""
        if self.capacity >= self._opts.capacity_bytes or self._closed:
            return
        assert self._pool is not None
        try:
            free = await run_in_thread(self._pool, self.files.free_bytes)
        except OSError:
            return  # the next write says more
        fits = min(self._opts.capacity_bytes, self._on_medium() - self._reserved + free)
        if fits > self.capacity:
            log.info("disk_tier_room_back", tier=self.name, capacity_bytes=self.capacity, new_capacity_bytes=fits)
            self.capacity = fits

    def _make_room(self, size: int) -> bool:
        """Evict until ``size`` more bytes fit; False (nothing changed beyond
        evictions) if they cannot."""
        if size > self.capacity:
            return False
        while self._used + self._reserved + size > self.capacity:
            victims = self.policy.victims(1, self._evictable)
            if not victims:
                return False
            self.counters.evictions += 1
            self._submit_delete(victims[0], self._forget(victims[0]))
        return True

    def _evictable(self, key: ChunkKey) -> bool:
        e = self._index[key]
        return e.pins == 0 and e.readers == 0

    # --- read ----------------------------------------------------------
    def submit_read(self, key: ChunkKey, meta: ObjectMeta, dst: MemoryObj) -> asyncio.Future | None:
        entry = self._index.get(key)
        if entry is None or self._closed or not self._health.allow():
            return None
        entry.readers += 1
        dst.ref_up()
        return self._exec.submit(Priority.PREFETCH, self._read_job, key, entry, dst,
                                 on_drop=partial(self._end_read, entry, dst))

    @staticmethod
    def _end_read(entry: _Entry, dst: MemoryObj) -> None:
        entry.readers -= 1
        dst.release()

    async def _read_job(self, key: ChunkKey, entry: _Entry, dst: MemoryObj) -> bool:
        assert self._pool is not None
        m = entry.meta
        try:
            status = await run_in_thread(self._pool, self.files.read, key, dst.numpy_bytes(),
                                         m.shape, m.dtype, m.layout)
        except OSError as e:
            self.counters.faults += 1
            self._health.fault(e)
            return False
        finally:
            self._end_read(entry, dst)
        self._health.ok()
        if status is ReadStatus.HIT:
            self.policy.on_hit(key)
            self.counters.bytes_out += dst.nbytes
            return True
        if self._index.get(key) is entry:
            size = self._forget(key)
            if status is ReadStatus.CORRUPT:
                self.counters.corrupt += 1
                log.warning("object_corrupt", tier=self.name, key=key.name)
                self._submit_delete(key, size)
        return False

    # --- remove, pins --------------------------------------------------
    def submit_remove(self, key: ChunkKey) -> bool:
        e = self._index.get(key)
        if e is None or e.pins or e.readers:
            return False
        self._submit_delete(key, self._forget(key))
        return True

    def _submit_delete(self, key: ChunkKey, size: int) -> None:
        """Unlink the file of ``key`` (``size`` bytes), already out of the index."""
        self._deleting[key] = (size, None)
        fut = self._exec.submit(Priority.DELETE, self._delete_job, key,
                                on_drop=partial(self._deleting.pop, key, None))
        if fut is not None:
            self._deleting[key] = (size, fut)

    async def _delete_job(self, key: ChunkKey) -> None:
        assert self._pool is not None
        try:
            await run_in_thread(self._pool, self.files.remove, key)
        except OSError as e:
            self.counters.faults += 1
            self._health.fault(e)
            return
        finally:
            self._deleting.pop(key, None)
        await self._regrow()

    def _add(self, key: ChunkKey, entry: _Entry) -> None:
        self._index[key] = entry
        self._used += entry.size
        self.policy.on_put(key)

    def _forget(self, key: ChunkKey) -> int:
        """Drop ``key`` from the index; returns its file's size."""
        entry = self._index.pop(key)
        self._used -= entry.size
        self.policy.on_remove(key)
        return entry.size

    def pin(self, key: ChunkKey) -> bool:
        e = self._index.get(key)
        if e is None:
            return False
        e.pins += 1
        return True

    def unpin(self, key: ChunkKey) -> None:
        e = self._index.get(key)
        if e is not None and e.pins:
            e.pins -= 1

    def pinned_count(self) -> int:
        return sum(1 for e in self._index.values() if e.pins)

    # --- lifecycle -----------------------------------------------------
    def stats(self) -> TierStats:
        return self.counters.snapshot(
            self.name, self.kind, available=self._health.available, usage_bytes=self._used,
            capacity_bytes=self.capacity, num_objects=len(self._index),
            dropped_puts=self._exec.dropped_puts,
        )

    async def drain(self) -> None:
        await self._exec.drain()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._exec.aclose()
        if self._pool is not None:
            self._pool.shutdown(wait=False)  # every job has finished; threads are idle
