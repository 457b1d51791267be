"""Benchmark of the tiered KV store (kvstrata.io); prints one JSON object.

Each figure is measured against a baseline in the same run, on the same
bytes, with a layout like a 7B model's (32 layers x 8 KV heads x 128 dims x
fp16, 256 tokens: 32 MiB per chunk):

  l1     store put + get (allocate, copy in, put; get, copy out) against a
         plain torch copy of the same bytes into and out of a host buffer
  disk   disk-tier writes (O_DIRECT + fsync) and reads (O_DIRECT, page cache
         dropped with posix_fadvise DONTNEED first) against `dd` writing /
         reading files of the same size with oflag=direct conv=fsync /
         iflag=direct, one file per chunk
  redis  redis-tier put + get against raw redis.asyncio SET / GET of the
         same bytes with the same concurrency, on one redis-server started here

Best of --repeat runs for every figure. Never asserts a time.

    python tools/bench_io.py                       # ~30 s on 2 cores
    python tools/bench_io.py --chunks 4 --layers 8 --no-redis
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvstrata.io import ChunkKey, CPUConfig, StorageManager, StoreConfig, TierSpec

LAYOUT = "cross_layer"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="directory for the disk tier (default: a temp dir)")
    p.add_argument("--io-threads", type=int, default=2)
    p.add_argument("--no-disk", action="store_true")
    p.add_argument("--no-redis", action="store_true")
    a = p.parse_args(argv)
    for name in ("chunks", "layers", "kv_heads", "head_dim", "tokens", "repeat", "io_threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return a


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def keys_for(run: int, n: int) -> list[ChunkKey]:
    return [ChunkKey("bench", run.to_bytes(4, "big") + i.to_bytes(4, "big"), 256) for i in range(n)]


def store_config(chunk_bytes: int, n: int, tiers=()) -> StoreConfig:
    cpu = CPUConfig(capacity_bytes=(n + 1) * chunk_bytes)
    return StoreConfig(cpu=cpu, tiers=tuple(tiers), close_timeout_s=300.0)


async def put_chunks(store: StorageManager, keys, src: torch.Tensor) -> None:
    """The connector's store path: allocate in L1, copy the chunk in, put."""
    for i, k in enumerate(keys):
        obj = store.allocate(src.shape[1:], src.dtype, LAYOUT)
        if obj is None:
            raise RuntimeError("L1 has no room: the benchmark sized it too small")
        obj.tensor.copy_(src[i])
        store.put(k, obj)
        obj.release()


async def get_chunks(store: StorageManager, keys, dst: torch.Tensor) -> int:
    """The connector's retrieve path: get from the store, copy each chunk out."""
    objs = await store.get(keys)
    for i, o in enumerate(objs):
        dst[i].copy_(o.tensor)
        o.release()
    return len(objs)


def filled(store: StorageManager, src: torch.Tensor):
    """Chunks already in L1 memory (not yet put): a lower tier's write is
    timed from the put, without the copy into L1."""
    objs = store.batched_allocate(src.shape[0], src.shape[1:], src.dtype, LAYOUT)
    if objs is None:
        raise RuntimeError("L1 has no room: the benchmark sized it too small")
    for i, o in enumerate(objs):
        o.tensor.copy_(src[i])
    return objs


async def timed_put(store: StorageManager, keys, objs) -> float:
    """put() of chunks already in L1, until every lower tier has them."""
    t0 = time.perf_counter()
    for k, o in zip(keys, objs):
        store.put(k, o)
    await store.drain()
    t = time.perf_counter() - t0
    for o in objs:
        o.release()
    return t


async def timed_get(store: StorageManager, keys, src: torch.Tensor) -> float:
    """get() from a lower tier into L1 (verified by the tier), then check."""
    t0 = time.perf_counter()
    objs = await store.get(keys)
    t = time.perf_counter() - t0
    try:
        assert len(objs) == len(keys) and all(torch.equal(o.tensor, src[i]) for i, o in enumerate(objs))
    finally:
        for o in objs:
            o.release()
    return t


# --- L1 ----------------------------------------------------------------
async def bench_l1(src: torch.Tensor, repeat: int) -> dict:
    n, chunk_bytes = src.shape[0], src[0].numel() * src.element_size()
    dst = torch.empty_like(src)
    host = torch.empty_like(src)
    best_store = best_copy = float("inf")
    async with StorageManager(store_config(chunk_bytes, n)) as store:
        for run in range(repeat + 1):  # run 0 warms up (first touch of every page)
            keys = keys_for(run, n)
            t0 = time.perf_counter()
            await put_chunks(store, keys, src)
            got = await get_chunks(store, keys, dst)
            t_store = time.perf_counter() - t0
            assert got == n and torch.equal(dst, src)
            t0 = time.perf_counter()
            for i in range(n):
                host[i].copy_(src[i])
            for i in range(n):
                dst[i].copy_(host[i])
            t_copy = time.perf_counter() - t0
            if run:
                best_store, best_copy = min(best_store, t_store), min(best_copy, t_copy)
    moved = 2 * n * chunk_bytes
    return {"store_put_get_GBps": gbps(moved, best_store), "torch_copy_GBps": gbps(moved, best_copy),
            "ratio": round(best_copy / best_store, 3), "goal": 0.8}


# --- disk --------------------------------------------------------------
def drop_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dd(args: list[str]) -> None:
    subprocess.run(["dd", *args, "status=none"], check=True)


def dd_baseline(d: Path, n: int, chunk_bytes: int, streams: int) -> tuple[float, float]:
    """dd writing then reading one file per chunk, ``streams`` at a time
    (the disk tier's I/O thread count)."""
    files = [d / f"dd{i}" for i in range(n)]

    def run(argsets) -> float:
        t0 = time.perf_counter()
        for b in range(0, len(argsets), streams):
            procs = [subprocess.Popen(["dd", *a, "status=none"]) for a in argsets[b:b + streams]]
            if any(p.wait() for p in procs):
                raise RuntimeError("dd failed")
        return time.perf_counter() - t0

    t_write = run([["if=/dev/zero", f"of={f}", f"bs={chunk_bytes}", "count=1", "oflag=direct",
                    "conv=fsync"] for f in files])
    drop_cache(files)
    t_read = run([[f"if={f}", "of=/dev/null", f"bs={chunk_bytes}", "iflag=direct"] for f in files])
    for f in files:
        f.unlink()
    return t_write, t_read


async def disk_once(store: StorageManager, src: torch.Tensor, d: Path, run: int) -> tuple[float, float]:
    """Write n chunks through the disk tier, then read them back cold."""
    keys = keys_for(run, src.shape[0])
    t_write = await timed_put(store, keys, filled(store, src))
    for k in keys:
        store.l1.remove(k)
    drop_cache(d.rglob("*.kvs"))
    t_read = await timed_get(store, keys, src)
    for k in keys:
        store.remove(k)
    await store.drain()
    return t_write, t_read


async def bench_disk(src: torch.Tensor, repeat: int, root: Path, io_threads: int) -> dict:
    n, chunk_bytes = src.shape[0], src[0].numel() * src.element_size()
    spec = TierSpec(type="disk", options=dict(path=str(root / "tier"), capacity_bytes=2 * n * (chunk_bytes + 4096),
                                              io_threads=io_threads, fsync=True, use_odirect=True))
    best = [float("inf")] * 4
    async with StorageManager(store_config(chunk_bytes, 2 * n, [spec])) as store:
        for run in range(repeat):
            t_w, t_r = await disk_once(store, src, root / "tier", run)
            d_w, d_r = dd_baseline(root, n, chunk_bytes, io_threads)
            best = [min(b, t) for b, t in zip(best, (t_w, t_r, d_w, d_r))]
        d = store.stats().tier("disk")
        assert d.puts == repeat * n and d.hit_chunks == repeat * n and d.corrupt == 0, d
        odirect = store.tiers[0].files.odirect
    total = n * chunk_bytes
    return {"write_GBps": gbps(total, best[0]), "dd_write_GBps": gbps(total, best[2]),
            "write_ratio": round(best[2] / best[0], 3),
            "read_GBps": gbps(total, best[1]), "dd_read_GBps": gbps(total, best[3]),
            "read_ratio": round(best[3] / best[1], 3), "goal": 0.7,
            "odirect": odirect, "fsync": True, "streams": io_threads,
            "cold_read": "O_DIRECT reads, after fsync + posix_fadvise(DONTNEED) on every file",
            "dir": str(root)}


# --- redis -------------------------------------------------------------
def start_redis(workdir: Path) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(500):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, port
        except OSError:
            time.sleep(0.01)
    proc.kill()
    raise RuntimeError("redis-server did not start")


async def raw_redis_once(port: int, payloads: list[bytes], run: int, conns: int) -> tuple[float, float]:
    import redis.asyncio as aioredis

    pool = aioredis.BlockingConnectionPool(host="127.0.0.1", port=port, max_connections=conns)
    r = aioredis.Redis(connection_pool=pool)
    try:
        names = [f"raw:{run}:{i}" for i in range(len(payloads))]
        t0 = time.perf_counter()
        await asyncio.gather(*(r.set(k, v) for k, v in zip(names, payloads)))
        t_set = time.perf_counter() - t0
        t0 = time.perf_counter()
        back = await asyncio.gather(*(r.get(k) for k in names))
        t_get = time.perf_counter() - t0
        assert [len(b) for b in back] == [len(p) for p in payloads]
        await r.delete(*names)
    finally:
        await r.aclose(close_connection_pool=True)
    return t_set, t_get


async def tier_redis_once(store: StorageManager, src: torch.Tensor, run: int) -> tuple[float, float]:
    keys = keys_for(run, src.shape[0])
    t_put = await timed_put(store, keys, filled(store, src))
    for k in keys:
        store.l1.remove(k)
    t_get = await timed_get(store, keys, src)
    for k in keys:
        store.remove(k)
    await store.drain()
    return t_put, t_get


async def bench_redis(src: torch.Tensor, repeat: int, workdir: Path, conns: int = 8) -> dict:
    n, chunk_bytes = src.shape[0], src[0].numel() * src.element_size()
    payloads = [src[i].contiguous().view(torch.uint8).numpy().tobytes() for i in range(n)]
    proc, port = start_redis(workdir)
    spec = TierSpec(type="redis", options=dict(port=port, max_in_flight=conns, max_connections=conns,
                                               max_queued_puts=max(64, n), socket_timeout_s=60.0))
    best = [float("inf")] * 4
    try:
        async with StorageManager(store_config(chunk_bytes, 2 * n, [spec])) as store:
            for run in range(repeat):
                t_p, t_g = await tier_redis_once(store, src, run)
                r_s, r_g = await raw_redis_once(port, payloads, run, conns)
                best = [min(b, t) for b, t in zip(best, (t_p, t_g, r_s, r_g))]
            r = store.stats().tier("redis")
            assert r.puts == repeat * n and r.hit_chunks == repeat * n and r.corrupt == 0, r
    finally:
        proc.kill()
        proc.wait()
    total = n * chunk_bytes
    return {"tier_put_get_GBps": gbps(2 * total, best[0] + best[1]),
            "raw_set_get_GBps": gbps(2 * total, best[2] + best[3]),
            "ratio": round((best[2] + best[3]) / (best[0] + best[1]), 3), "goal": 0.8,
            "tier_put_GBps": gbps(total, best[0]), "tier_get_GBps": gbps(total, best[1]),
            "raw_set_GBps": gbps(total, best[2]), "raw_get_GBps": gbps(total, best[3]),
            "connections": conns}


async def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    shape = (a.layers, 2, a.tokens, a.kv_heads, a.head_dim)
    src = torch.randn(a.chunks, *shape).to(torch.float16)
    chunk_bytes = src[0].numel() * src.element_size()
    result: dict = {"config": {"chunks": a.chunks, "chunk_shape": list(shape), "dtype": "float16",
                               "chunk_MiB": round(chunk_bytes / 2**20, 3), "repeat": a.repeat,
                               "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}}
    result["l1"] = await bench_l1(src, a.repeat)
    tmp = Path(tempfile.mkdtemp(prefix="kvstrata-bench-", dir=a.dir))
    try:
        if not a.no_disk:
            result["disk"] = await bench_disk(src, min(a.repeat, 2), tmp, a.io_threads)
        if not a.no_redis:
            if shutil.which("redis-server") is None:
                result["redis"] = {"skipped": "redis-server not installed"}
            else:
                result["redis"] = await bench_redis(src, a.repeat, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


if __name__ == "__main__":
    import logging

    from kvstrata.logs import configure_logging

    configure_logging("WARNING")
    logging.getLogger().setLevel(logging.WARNING)
    print(json.dumps(asyncio.run(main(sys.argv[1:])), indent=2))
