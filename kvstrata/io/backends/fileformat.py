"""The object file format shared by the disk and shared-filesystem tiers, and
the blocking operations on it (always run on a tier's thread pool).

One file per object, ``{root}/{identity}/{key.name}.kvs``::

    offset 0     magic "KVSTRATA" | version u16 | flags u16 | meta_len u32 |
                 payload_len u64 | checksum u64          (32 bytes, little endian)
    offset 32    meta: msgpack [key, shape, dtype, layout]
    ...          zero padding up to header_len (a multiple of 4 KiB)
    header_len   payload (payload_len bytes)

checksum = xxh3_64(meta + payload). Writes go to a unique temp file in the same
directory, then ``rename`` (atomic on POSIX), so a reader sees a whole file or
none. O_DIRECT is used when the buffer and lengths are 4 KiB aligned and the
filesystem accepts it; otherwise ordinary buffered I/O.
"""

from __future__ import annotations

import enum
import errno
import os
import struct
import uuid
from pathlib import Path

import msgspec
import numpy as np
import xxhash

from kvstrata.io.keys import ChunkKey
from kvstrata.io.memory import ALIGN, align_up

MAGIC = b"KVSTRATA"
VERSION = 1
SUFFIX = ".kvs"
TMP_SUFFIX = ".tmp"
_PREFIX = struct.Struct("<8sHHIQQ")
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class FileMeta(msgspec.Struct, frozen=True, array_like=True, gc=False):
    key: ChunkKey
    shape: tuple[int, ...]
    dtype: str
    layout: str


class Header(msgspec.Struct, frozen=True, gc=False):
    meta: FileMeta
    meta_bytes: bytes
    header_len: int
    payload_len: int
    checksum: int

    @property
    def file_size(self) -> int:
        return self.header_len + self.payload_len


class ReadStatus(enum.Enum):
    HIT = "hit"
    MISSING = "missing"
    CORRUPT = "corrupt"


class CorruptObject(Exception):
    """A stored object failed a format or checksum check."""


_meta_decoder = msgspec.msgpack.Decoder(FileMeta)


def checksum(meta_bytes: bytes, payload: np.ndarray) -> int:
    h = xxhash.xxh3_64(meta_bytes)
    h.update(payload)
    return h.intdigest()


def parse_header(page: bytes | memoryview) -> Header:
    """Parse the header from the first bytes of a file (at least header_len)."""
    if len(page) < _PREFIX.size:
        raise CorruptObject("short header")
    magic, version, _flags, meta_len, payload_len, csum = _PREFIX.unpack_from(page, 0)
    if magic != MAGIC or version != VERSION:
        raise CorruptObject(f"bad magic or version {version}")
    end = _PREFIX.size + meta_len
    if end > len(page):
        raise CorruptObject("meta past the header")
    meta_bytes = bytes(page[_PREFIX.size:end])
    try:
        meta = _meta_decoder.decode(meta_bytes)
    except (msgspec.DecodeError, ValueError) as e:
        raise CorruptObject(f"bad meta: {e}") from None
    return Header(meta, meta_bytes, align_up(end), payload_len, csum)


def _aligned(buf: np.ndarray) -> bool:
    return buf.ctypes.data % ALIGN == 0 and buf.nbytes % ALIGN == 0


def aligned_array(nbytes: int) -> np.ndarray:
    """A zeroed uint8 array starting on a 4 KiB boundary (for O_DIRECT)."""
    raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off:off + nbytes]


class ObjectFiles:
    """Blocking file operations under one root directory.

    Owns: the root path and whether O_DIRECT still works here (it is turned
    off for good after the first EINVAL). Safe to call from several threads.
    """

    def __init__(self, root: str | os.PathLike, *, use_odirect: bool, fsync: bool) -> None:
        self.root = Path(root)
        self.odirect = bool(use_odirect and _O_DIRECT)
        self.fsync = fsync

    def path_for(self, key: ChunkKey) -> Path:
        return self.root / key.identity / f"{key.name}{SUFFIX}"

    # --- write ---------------------------------------------------------
    def write(self, key: ChunkKey, payload: np.ndarray, shape: tuple[int, ...], dtype: str,
              layout: str) -> int:
        """Write atomically; returns the file size. OSError on faults."""
        meta_bytes = msgspec.msgpack.encode(FileMeta(key, shape, dtype, layout))
        header_len = align_up(_PREFIX.size + len(meta_bytes))
        header = aligned_array(header_len)
        _PREFIX.pack_into(header, 0, MAGIC, VERSION, 0, len(meta_bytes), payload.nbytes,
                          checksum(meta_bytes, payload))
        header[_PREFIX.size:_PREFIX.size + len(meta_bytes)] = np.frombuffer(meta_bytes, np.uint8)
        final = self.path_for(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f"{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
        try:
            fd = self._open_write(tmp, _aligned(payload))
            try:
                _write_all(fd, memoryview(header), 0)
                _write_all(fd, memoryview(payload), header_len)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
        except BaseException:
            _unlink_quiet(tmp)
            raise
        return header_len + payload.nbytes

    def _open_write(self, path: Path, aligned: bool) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        if self.odirect and aligned:
            try:
                return os.open(path, flags | _O_DIRECT, 0o644)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.odirect = False  # this filesystem refuses O_DIRECT
        return os.open(path, flags, 0o644)

    # --- read ----------------------------------------------------------
    def read_header(self, path: Path) -> Header | None:
        """The file's header; None if the file is gone. CorruptObject if bad."""
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        try:
            return self._read_header_fd(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def read(self, key: ChunkKey, dst: np.ndarray, shape: tuple[int, ...], dtype: str,
             layout: str) -> ReadStatus:
        """Read and verify the object into ``dst``. OSError on faults."""
        path = self.path_for(key)
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        use_direct = self.odirect and _aligned(dst)
        try:
            fd = os.open(path, flags | (_O_DIRECT if use_direct else 0))
        except FileNotFoundError:
            return ReadStatus.MISSING
        except OSError as e:
            if e.errno != errno.EINVAL or not use_direct:
                raise
            self.odirect = False
            return self.read(key, dst, shape, dtype, layout)
        try:
            size = os.fstat(fd).st_size
            h = self._read_header_fd(fd, size)
            m = h.meta
            if (m.key != key or m.shape != tuple(shape) or m.dtype != dtype or m.layout != layout
                    or h.payload_len != dst.nbytes or size != h.file_size):
                raise CorruptObject("header does not match the object asked for, or truncated")
            if _read_all(fd, memoryview(dst), h.header_len) != dst.nbytes:
                raise CorruptObject("truncated payload")
            if checksum(h.meta_bytes, dst) != h.checksum:
                raise CorruptObject("checksum mismatch")
        except CorruptObject:
            return ReadStatus.CORRUPT
        finally:
            os.close(fd)
        return ReadStatus.HIT

    def _read_header_fd(self, fd: int, size: int) -> Header:
        page = aligned_array(ALIGN)  # aligned, in case fd is O_DIRECT
        n = _read_all(fd, memoryview(page), 0)
        h = parse_header(page[:n].tobytes())
        if h.header_len > ALIGN:  # a meta this version never writes; read the rest
            big = aligned_array(h.header_len)
            h = parse_header(big[:_read_all(fd, memoryview(big), 0)].tobytes())
        if size < h.file_size:
            raise CorruptObject("truncated file")
        return h

    # --- maintenance ---------------------------------------------------
    def remove(self, key: ChunkKey) -> bool:
        return _unlink_quiet(self.path_for(key))

    def free_bytes(self) -> int:
        """Bytes the filesystem under root has room for now (statvfs)."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def scan(self) -> tuple[list[tuple[Header, float]], int]:
        """Headers of every object file under root (with mtime), oldest first.
        Removes temp files left by a crash and files with a bad header;
        returns (entries, number of bad files removed)."""
        entries: list[tuple[Header, float]] = []
        bad = 0
        self.root.mkdir(parents=True, exist_ok=True)
        for sub in os.scandir(self.root):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for f in os.scandir(sub.path):
                path = Path(f.path)
                if f.name.endswith(TMP_SUFFIX):
                    _unlink_quiet(path)
                    continue
                if not f.name.endswith(SUFFIX):
                    continue
                try:
                    h = self.read_header(path)
                    mtime = f.stat().st_mtime
                except CorruptObject:
                    bad += _unlink_quiet(path)
                    continue
                except FileNotFoundError:  # removed while we scanned
                    continue
                if h is None:
                    continue
                if path == self.path_for(h.meta.key):
                    entries.append((h, mtime))
                else:
                    bad += _unlink_quiet(path)  # renamed or copied under a wrong name
        entries.sort(key=lambda e: e[1])
        return entries, bad


def _write_all(fd: int, buf: memoryview, offset: int) -> None:
    buf = buf.cast("B")
    done = 0
    while done < len(buf):
        n = os.pwrite(fd, buf[done:], offset + done)
        if n == 0:
            raise OSError(errno.EIO, "write returned 0")
        done += n


def _read_all(fd: int, buf: memoryview, offset: int) -> int:
    buf = buf.cast("B")
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def _unlink_quiet(path: Path) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
