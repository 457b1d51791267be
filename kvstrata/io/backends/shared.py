"""The common part of the tiers whose medium other engines share (a shared
filesystem, Redis): no local index (``has`` is always None, ``metas`` asks
the medium), no capacity management (the medium's owner runs its own), no
pins (this process cannot keep other hosts from deleting). Subclasses
provide the medium: ``metas``, ``_write`` (one put), ``_read_job``,
``submit_remove``, ``_fault`` and ``_close_medium``, and name the
exceptions that mean "the medium failed" in ``faults``.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Protocol

from kvstrata.io.backends.base import Health, ObjectMeta
from kvstrata.io.config import HealthConfig, TierSpec, decode_options
from kvstrata.io.executors import Priority, PriorityExecutor
from kvstrata.io.keys import ChunkKey
from kvstrata.io.memory import MemoryObj
from kvstrata.io.stats import TierCounters, TierStats


class SharedOptions(Protocol):
    """What the common part reads of a tier's options Struct (``FSOptions``,
    ``RedisOptions``, ...); each subclass narrows ``_opts`` to its own."""

    @property
    def health(self) -> HealthConfig: ...

    @property
    def max_queued_puts(self) -> int: ...

    def validate(self, prefix: str) -> None: ...


class SharedMediumTier:
    """Owns: the keys being written by this process, the priority executor,
    the thread pool and the health state. The objects belong to the medium."""

    kind = ""
    options_type: type = object
    faults: tuple[type[BaseException], ...] = (OSError,)

    def __init__(self, opts: SharedOptions, *, name: str, write_back: bool, max_in_flight: int) -> None:
        opts.validate(name)
        self.name = name
        self.write_back = write_back
        self.counters = TierCounters()
        self._opts = opts
        self._health = Health(name, opts.health)
        self._writing: set[ChunkKey] = set()
        self._pool: ThreadPoolExecutor | None = None
        self._exec = PriorityExecutor(name, max_in_flight=max_in_flight, max_queued_puts=opts.max_queued_puts)
        self._closed = False

    @classmethod
    def from_spec(cls, spec: TierSpec, prefix: str) -> SharedMediumTier:
        opts = decode_options(spec.options, cls.options_type, f"{prefix}.options")
        return cls(opts, name=spec.name or spec.type, write_back=spec.write == "back")

    @property
    def available(self) -> bool:
        return self._health.available

    @property
    def pending(self) -> int:
        return self._exec.pending

    def has(self, key: ChunkKey) -> bool | None:
        return None

    def _open(self) -> bool:
        """Started and not closed (subclasses add their connection)."""
        return not self._closed

    def _usable(self) -> bool:
        return self._open() and self._health.allow()

    # --- put and read: queueing (the jobs are the medium's) -------------
    def submit_put(self, key: ChunkKey, obj: MemoryObj) -> asyncio.Future | None:
        if key in self._writing or not self._open():
            return None
        if not self._health.allow():
            self.counters.dropped_puts += 1
            return None
        self._writing.add(key)
        obj.ref_up()
        return self._exec.submit(Priority.PUT, self._put_job, key, obj,
                                 on_drop=partial(self._end_put, key, obj))

    def _end_put(self, key: ChunkKey, obj: MemoryObj) -> None:
        self._writing.discard(key)
        obj.release()

    def submit_read(self, key: ChunkKey, meta: ObjectMeta, dst: MemoryObj) -> asyncio.Future | None:
        if not self._usable():
            return None
        dst.ref_up()
        return self._exec.submit(Priority.PREFETCH, self._read_job, key, meta, dst,
                                 on_drop=dst.release)

    async def _put_job(self, key: ChunkKey, obj: MemoryObj) -> bool:
        """One queued put: the medium's ``_write``, with the counting and
        fault handling every shared medium does the same way."""
        try:
            stored = await self._write(key, obj)
        except self.faults as e:
            self.counters.dropped_puts += 1
            self._fault(e)
            return False
        finally:
            self._end_put(key, obj)
        self._health.ok()
        if stored:
            self.counters.puts += 1
            self.counters.bytes_in += obj.nbytes
        return stored

    async def _write(self, key: ChunkKey, obj: MemoryObj) -> bool:
        """Store ``obj`` unless the medium has it; True when it was written."""
        raise NotImplementedError

    def _fault(self, e: BaseException) -> None:
        raise NotImplementedError

    async def _read_job(self, key: ChunkKey, meta: ObjectMeta, dst: MemoryObj) -> bool:
        raise NotImplementedError

    # --- no pins on a shared medium ---------------------------------------
    def pin(self, key: ChunkKey) -> bool:
        return False

    def unpin(self, key: ChunkKey) -> None:
        pass

    def pinned_count(self) -> int:
        return 0

    # --- lifecycle ---------------------------------------------------------
    def stats(self) -> TierStats:
        return self.counters.snapshot(
            self.name, self.kind, available=self._health.available, usage_bytes=0,
            capacity_bytes=0, num_objects=0, dropped_puts=self._exec.dropped_puts,
        )

    async def drain(self) -> None:
        await self._exec.drain()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._exec.aclose()
        finally:
            await self._close_medium()
            if self._pool is not None:
                self._pool.shutdown(wait=False)

    async def _close_medium(self) -> None:
        """Release the medium's own resources (a connection pool)."""
