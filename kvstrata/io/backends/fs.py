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

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import structlog

from kvstrata.io.backends.base import ObjectMeta
from kvstrata.io.backends.shared import SharedMediumTier
from kvstrata.io.backends.fileformat import CorruptObject, ObjectFiles, ReadStatus
from kvstrata.io.config import FSOptions
from kvstrata.io.executors import Priority, run_in_thread
from kvstrata.io.keys import ChunkKey
from kvstrata.io.memory import MemoryObj, dtype_name

log = structlog.get_logger(__name__)


class FSTier(SharedMediumTier):
    """Owns: the file format handler; the rest as SharedMediumTier. The files
    belong to the filesystem."""

    kind = "fs"
    options_type = FSOptions
    _opts: FSOptions

    def __init__(self, opts: FSOptions, *, name: str = "fs", write_back: bool = False) -> None:
        super().__init__(opts, name=name, write_back=write_back, max_in_flight=opts.io_threads)
        self.files = ObjectFiles(opts.path, use_odirect=opts.use_odirect, fsync=opts.fsync)

    async def start(self) -> None:
        self._pool = ThreadPoolExecutor(self._opts.io_threads, thread_name_prefix=f"kvstrata-{self.name}")
        try:
            await run_in_thread(self._pool, partial(self.files.root.mkdir, parents=True, exist_ok=True))
        except OSError as e:
            self._fault(e)

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

    def _write_if_absent(self, key: ChunkKey, obj: MemoryObj) -> bool:
        if self.files.path_for(key).exists():
            return False
        self.files.write(key, obj.numpy_bytes(), obj.shape, dtype_name(obj.dtype), obj.layout)
        return True

    async def _write(self, key: ChunkKey, obj: MemoryObj) -> bool:
        assert self._pool is not None
        return await run_in_thread(self._pool, self._write_if_absent, key, obj)

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
