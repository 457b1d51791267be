"""Shared builders for the tiered-store tests: keys, object contents, a
real redis-server process, and real filesystem faults (an immutable
directory for permission denied, a tiny tmpfs for disk full)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis
import torch

from kvstrata.io import ChunkKey, MemoryObj, StorageManager
from kvstrata.io.sources import Pin

IDENT = "0123456789abcdef0123456789abcdef"
SHAPE = (2, 1024)  # float32: 8 KiB, two pages
DTYPE = torch.float32
OBJ_BYTES = 8192
FILE_BYTES = 4096 + OBJ_BYTES  # header page + payload
REDIS_BIN = shutil.which("redis-server") or "/usr/bin/redis-server"


def key(i: int, *, tokens: int = 256, layer: int = -1, ident: str = IDENT) -> ChunkKey:
    return ChunkKey(ident, i.to_bytes(4, "big") * 8, tokens, layer)


def pattern(i: int, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    """Contents that differ for every key and every position."""
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float32) + i * 1_000_003).reshape(shape)


def put_pattern(store: StorageManager, i: int, **kw) -> MemoryObj | None:
    """Allocate, fill with ``pattern(i)``, put under ``key(i)``, release."""
    obj = store.allocate(SHAPE, DTYPE, "test")
    if obj is None:
        return None
    obj.tensor.copy_(pattern(i))
    store.put(key(i, **kw), obj)
    obj.release()
    return obj


async def put_all(store: StorageManager, ids) -> None:
    """put_pattern each id, draining the lower tiers after each."""
    for i in ids:
        assert put_pattern(store, i) is not None
        await store.drain()


async def pin_leading(store: StorageManager, keys: list[ChunkKey]) -> list[Pin]:
    """Pin the leading ``keys`` some tier holds, where ``locate`` finds them."""
    srcs = await store.locate(keys)
    return store.pin(keys[: len(srcs)], srcs)


async def get_ids(store: StorageManager, ids) -> list[int]:
    """The ids ``get`` served, checking every byte; releases the objects."""
    objs = await store.get([key(i) for i in ids])
    try:
        for i, o in zip(ids, objs):
            assert torch.equal(o.tensor, pattern(i)), f"wrong data for {i}"
        return list(ids[: len(objs)])
    finally:
        for o in objs:
            o.release()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server process on a loopback port (no persistence)."""

    def __init__(self, workdir: Path, *extra: str) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.extra = list(extra)
        self.password: str | None = None
        if "--requirepass" in extra:
            self.password = extra[extra.index("--requirepass") + 1]
        self.proc: subprocess.Popen | None = None

    def _spawn(self) -> None:
        args = [REDIS_BIN, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), *self.extra]
        if "--tls-port" not in self.extra:
            args += ["--port", str(self.port)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def start(self) -> None:
        self._spawn()
        deadline = time.monotonic() + 10
        while not self._ready():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.02)

    async def astart(self) -> None:
        """Start from inside a test's event loop without blocking it."""
        self._spawn()
        for _ in range(500):
            if await asyncio.to_thread(self._ready):
                return
            await asyncio.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password)

    def options(self, **kw) -> dict:
        opts = dict(host="127.0.0.1", port=self.port, password=self.password,
                    health=dict(retry_interval_s=0.05, max_retry_interval_s=0.1))
        opts.update(kw)
        return opts


@contextlib.contextmanager
def writes_denied(path: Path):
    """Real EPERM/EACCES on creating files in ``path``: an immutable
    directory as root (root ignores modes), mode 0o500 otherwise."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(path)], check=True)
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        mode = path.stat().st_mode
        path.chmod(0o500)
        try:
            yield
        finally:
            path.chmod(mode)


def can_chattr(tmp: Path) -> bool:
    if os.geteuid() != 0:
        return True
    probe = tmp / "chattr-probe"
    probe.mkdir()
    ok = subprocess.run(["chattr", "+i", str(probe)], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["chattr", "-i", str(probe)], check=True)
    probe.rmdir()
    return ok


class TinyFS:
    """A small tmpfs mounted in a private mount namespace (``unshare -rm``),
    reached from this process through /proc/<pid>/root: writes past its
    size fail with a real ENOSPC."""

    def __init__(self, mountpoint: Path, size_kib: int) -> None:
        mountpoint.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            ["unshare", "-rm", "sh", "-c",
             f"mount -t tmpfs -o size={size_kib}k tmpfs {mountpoint} && echo ready && exec sleep 600"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if line.strip() != "ready":
            self.close()
            raise OSError("cannot mount a private tmpfs here")
        self.path = Path(f"/proc/{self.proc.pid}/root{mountpoint}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
