"""L3: a filesystem shared by several engines (NFS, Lustre, a mounted
bucket), in the disk tier's file format.

Other processes add and remove files at any time, so there is no local
index: ``metas`` reads the headers, and a put first checks whether another
writer got there first. Temp file names carry pid and a random suffix, and
rename is atomic, so concurrent writers of one key are safe. There is no
capacity management here (the filesystem's owner runs its own); objects
cannot be pinned for other hosts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import structlog

from kvstrata.io.backends.base import Health, ObjectMeta
from kvstrata.io.backends.fileformat import CorruptObject, ObjectFiles, ReadStatus
from kvstrata.io.config import FSOptions, TierSpec, decode_options
from kvstrata.io.executors import Priority, PriorityExecutor, run_in_thread
from kvstrata.io.keys import ChunkKey
from kvstrata.io.memory import MemoryObj, dtype_name
from kvstrata.io.stats import TierCounters, TierStats

log = structlog.get_logger(__name__)


class FSTier:
    """Owns: the keys being written by this process, the executor, the
    thread pool and the health state. The files belong to the filesystem."""

    kind = "fs"

    def __init__(self, opts: FSOptions, *, name: str = "fs", write_back: bool = False) -> None:
        opts.validate(name)
        self.name = name
        self.write_back = write_back
        self.counters = TierCounters()
        self.files = ObjectFiles(opts.path, use_odirect=opts.use_odirect, fsync=opts.fsync)
        self._opts = opts
        self._health = Health(name, opts.health)
        self._writing: set[ChunkKey] = set()
        self._pool: ThreadPoolExecutor | None = None
        self._exec = PriorityExecutor(name, max_in_flight=opts.io_threads,
                                      max_queued_puts=opts.max_queued_puts)
        self._closed = False

    @classmethod
    def from_spec(cls, spec: TierSpec, prefix: str) -> FSTier:
        opts = decode_options(spec.options, FSOptions, f"{prefix}.options")
        return cls(opts, name=spec.name or spec.type, write_back=spec.write == "back")

    async def start(self) -> None:
        self._pool = ThreadPoolExecutor(self._opts.io_threads, thread_name_prefix=f"kvstrata-{self.name}")
        try:
            await run_in_thread(self._pool, partial(self.files.root.mkdir, parents=True, exist_ok=True))
        except OSError as e:
            self._fault(e)

    @property
    def available(self) -> bool:
        return self._health.available

    @property
    def pending(self) -> int:
        return self._exec.pending

    def has(self, key: ChunkKey) -> bool | None:
        return None

    async def metas(self, keys: Sequence[ChunkKey]) -> list[ObjectMeta | None]:
        if not keys or self._closed or not self._health.allow():
            return [None] * len(keys)
        assert self._pool is not None
        try:
            found, bad = await run_in_thread(self._pool, self._read_metas, list(keys))
        except OSError as e:
            self._fault(e)
            return [None] * len(keys)
        self._health.ok()
        self.counters.corrupt += bad
        return found

    def _read_metas(self, keys: list[ChunkKey]) -> tuple[list[ObjectMeta | None], int]:
        """Thread side: headers of the keys' files; bad headers are deleted."""
        out: list[ObjectMeta | None] = []
        bad = 0
        for key in keys:
            path = self.files.path_for(key)
            try:
                h = self.files.read_header(path)
            except CorruptObject:
                bad += self.files.remove(key)
                h = None
            if h is not None and h.meta.key != key:
                bad += self.files.remove(key)
                h = None
            out.append(None if h is None else
                       ObjectMeta(h.meta.shape, h.meta.dtype, h.meta.layout, h.payload_len))
        return out, bad

    def submit_put(self, key: ChunkKey, obj: MemoryObj) -> asyncio.Future | None:
        if key in self._writing or self._closed:
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

    def _write_if_absent(self, key: ChunkKey, obj: MemoryObj) -> bool:
        if self.files.path_for(key).exists():
            return False
        self.files.write(key, obj.numpy_bytes(), obj.shape, dtype_name(obj.dtype), obj.layout)
        return True

    async def _put_job(self, key: ChunkKey, obj: MemoryObj) -> bool:
        assert self._pool is not None
        try:
            wrote = await run_in_thread(self._pool, self._write_if_absent, key, obj)
        except OSError as e:
            self.counters.dropped_puts += 1
            self._fault(e)
            return False
        finally:
            self._end_put(key, obj)
        self._health.ok()
        if wrote:
            self.counters.puts += 1
            self.counters.bytes_in += obj.nbytes
        return wrote

    def submit_read(self, key: ChunkKey, meta: ObjectMeta, dst: MemoryObj) -> asyncio.Future | None:
        if self._closed or not self._health.allow():
            return None
        dst.ref_up()
        return self._exec.submit(Priority.PREFETCH, self._read_job, key, meta, dst,
                                 on_drop=dst.release)

    async def _read_job(self, key: ChunkKey, meta: ObjectMeta, dst: MemoryObj) -> bool:
        assert self._pool is not None
        try:
            status = await run_in_thread(self._pool, self.files.read, key, dst.numpy_bytes(),
                                         meta.shape, meta.dtype, meta.layout)
        except OSError as e:
            self._fault(e)
            return False
        finally:
            dst.release()
        self._health.ok()
        if status is ReadStatus.CORRUPT:
            self.counters.corrupt += 1
            log.warning("object_corrupt", tier=self.name, key=key.name)
            self.submit_remove(key)
        elif status is ReadStatus.HIT:
            self.counters.bytes_out += dst.nbytes
        return status is ReadStatus.HIT

    def submit_remove(self, key: ChunkKey) -> bool:
        if self._closed:
            return False
        return self._exec.submit(Priority.DELETE, self._delete_job, key) is not None

    async def _delete_job(self, key: ChunkKey) -> None:
        assert self._pool is not None
        try:
            await run_in_thread(self._pool, self.files.remove, key)
        except OSError as e:
            self._fault(e)

    def _fault(self, e: OSError) -> None:
        self.counters.faults += 1
        self._health.fault(e)

    def pin(self, key: ChunkKey) -> bool:
        return False

    def unpin(self, key: ChunkKey) -> None:
        pass

    def pinned_count(self) -> int:
        return 0

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
        await self._exec.aclose()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
