"""L3: a Redis server through ``redis.asyncio``.

Each object is two Redis keys under the cache identity's namespace::

    {key_prefix}:{identity}:{name}:d   the payload bytes (sent zero-copy)
    {key_prefix}:{identity}:{name}:m   msgpack [key, shape, dtype, layout, nbytes, xxh3_64]

A put first asks whether the meta exists (another engine may have stored the
same prefix; then nothing is sent), else writes data then meta in one
pipeline, so a reader that finds the meta finds the data; a read MGETs both and checks the key, the size and the
checksum (in a thread, with the copy into L1). Connection faults make the
tier unavailable (see ``Health``); the client reconnects on the next attempt
after the retry interval. Redis cannot pin for us: ``pin`` is always False.

``RedisStoreBase`` holds all of that; ``RedisTier`` adds the single-server
client and key layout, ``redis_cluster.RedisClusterTier`` a Redis Cluster's
(whose faults may take one shard only: see its ``_shard`` hooks).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import redis.asyncio as aioredis
import structlog
import xxhash
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from kvstrata.io.backends.base import ObjectMeta
from kvstrata.io.backends.redis_tls import SharedContextSSLConnection, tls_context
from kvstrata.io.backends.shared import SharedMediumTier
from kvstrata.io.config import RedisClusterOptions, RedisOptions
from kvstrata.io.executors import Priority, run_in_thread
from kvstrata.io.keys import ChunkKey
from kvstrata.io.memory import MemoryObj, dtype_name

log = structlog.get_logger(__name__)


class RedisMeta(msgspec.Struct, frozen=True, array_like=True, gc=False):
    key: ChunkKey
    shape: tuple[int, ...]
    dtype: str
    layout: str
    nbytes: int
    checksum: int


_decode_meta = msgspec.msgpack.Decoder(RedisMeta).decode
_encode = msgspec.msgpack.encode
_FAULTS = (RedisError, OSError, asyncio.TimeoutError)


class ShardDown(RedisError):
    """The shard that holds a key is marked down: the op was skipped
    without I/O (a miss, or a dropped put; not a new fault)."""


def _verify_copy(data: bytes, meta: RedisMeta, dst: np.ndarray) -> bool:
    """Thread side: checksum the received bytes, then copy them into L1."""
    if len(data) != dst.nbytes or xxhash.xxh3_64_intdigest(data) != meta.checksum:
        return False
    np.copyto(dst, np.frombuffer(data, dtype=np.uint8))
    return True


class RedisStoreBase(SharedMediumTier):
    """Owns: the client (``_client``, made by ``_connect``); the rest as
    SharedMediumTier (its thread pool checksums and copies). Subclasses give
    ``_connect``, ``_probe``, ``_rkey`` and ``_mget_metas``; a sharded medium
    also ``_shard``/``_shard_allows``/``_ok``/``_fault`` (one shard's fault
    then costs only that shard's keys)."""

    faults = _FAULTS
    _opts: RedisOptions | RedisClusterOptions

    def __init__(self, opts, *, name: str, write_back: bool = False) -> None:
        super().__init__(opts, name=name, write_back=write_back, max_in_flight=opts.max_in_flight)
        self._client = None

    async def start(self) -> None:
        """Connect and probe; a medium that is down leaves the tier
        unavailable (retried later), it does not raise."""
        tls = await asyncio.to_thread(tls_context, self._opts, self.name) if self._opts.ssl else None
        self._client = self._connect(tls)
        self._pool = ThreadPoolExecutor(self._opts.io_threads, thread_name_prefix=f"kvstrata-{self.name}")
        try:
            await self._probe()
        except self.faults as e:
            self._fault(e)

    def _connect(self, tls: ssl.SSLContext | None):
        """The client; with ``tls`` (the tier's one context, ``redis_tls``)
        every connection speaks TLS on it."""
        raise NotImplementedError

    async def _probe(self) -> None:
        raise NotImplementedError

    def _rkey(self, key: ChunkKey, part: str) -> str:
        raise NotImplementedError

    async def _mget_metas(self, rkeys: list[str]) -> list[bytes | None]:
        """The meta values of ``rkeys`` (None: absent, or its shard failed);
        marks the shards that answered ok."""
        raise NotImplementedError

    # --- shards: one for a single server ---------------------------------
    def _shard(self, key: ChunkKey) -> str | None:
        """Which shard holds ``key`` (None: the only one, or not known yet)."""
        return None

    def _shard_allows(self, shard: str | None) -> bool:
        return True

    def _ok(self, shard: str | None) -> None:
        self._health.ok()

    def _open(self) -> bool:
        return self._client is not None and not self._closed

    def _fault(self, e: BaseException) -> None:
        self.counters.faults += 1
        if isinstance(e, ResponseError):  # a refused command (OOM, ...), not a dead link
            return
        self._health.fault(e)

    @staticmethod
    def _tag(e: BaseException, shard: str | None) -> BaseException:
        """Mark a fault with the shard it came from (read by ``_fault``)."""
        if shard is not None and getattr(e, "kvstrata_shard", None) is None:
            e.kvstrata_shard = shard
        return e

    # --- lookup --------------------------------------------------------
    async def metas(self, keys: Sequence[ChunkKey]) -> list[ObjectMeta | None]:
        if not keys or not self._usable():
            return [None] * len(keys)
        try:
            raw = await self._mget_metas([self._rkey(k, "m") for k in keys])
        except self.faults as e:
            self._fault(e)
            return [None] * len(keys)
        out: list[ObjectMeta | None] = []
        for key, blob in zip(keys, raw):
            m = self._parse(key, blob)
            out.append(None if m is None else ObjectMeta(m.shape, m.dtype, m.layout, m.nbytes))
        return out

    def _parse(self, key: ChunkKey, blob: bytes | None) -> RedisMeta | None:
        if blob is None:
            return None
        try:
            m = _decode_meta(blob)
        except (msgspec.DecodeError, ValueError):
            m = None
        if m is None or m.key != key:
            self._corrupt(key)
            return None
        return m

    def _corrupt(self, key: ChunkKey) -> None:
        self.counters.corrupt += 1
        log.warning("object_corrupt", tier=self.name, key=key.name)
        self.submit_remove(key)

    # --- put -----------------------------------------------------------
    async def _write(self, key: ChunkKey, obj: MemoryObj) -> bool:
        assert self._client is not None and self._pool is not None
        shard = self._shard(key)
        if not self._shard_allows(shard):
            raise ShardDown(f"shard {shard} is down")
        try:
            if await self._client.exists(self._rkey(key, "m")):
                self._ok(shard)
                return False  # already there
            payload = obj.numpy_bytes()
            csum = await run_in_thread(self._pool, xxhash.xxh3_64_intdigest, payload)
            meta = _encode(RedisMeta(key, obj.shape, dtype_name(obj.dtype), obj.layout, obj.nbytes, csum))
            pipe = self._client.pipeline(transaction=False)
            pipe.set(self._rkey(key, "d"), memoryview(payload), ex=self._opts.ttl_s)
            pipe.set(self._rkey(key, "m"), meta, ex=self._opts.ttl_s)
            await pipe.execute()
        except self.faults as e:
            raise self._tag(e, shard)
        self._ok(shard)
        return True

    # --- read ----------------------------------------------------------
    async def _read_job(self, key: ChunkKey, want: ObjectMeta, dst: MemoryObj) -> bool:
        assert self._client is not None and self._pool is not None
        shard = self._shard(key)
        try:
            if not self._shard_allows(shard):
                return False
            blob, data = await self._client.mget([self._rkey(key, "m"), self._rkey(key, "d")])
            m = self._parse(key, blob)
            if m is None or data is None:
                if m is not None:  # meta without data: the server evicted the data
                    self.submit_remove(key)
                self._ok(shard)
                return False
            if (m.shape, m.dtype, m.layout, m.nbytes) != (want.shape, want.dtype, want.layout, want.nbytes):
                self._corrupt(key)
                return False
            ok = await run_in_thread(self._pool, _verify_copy, data, m, dst.numpy_bytes())
        except self.faults as e:
            self._fault(self._tag(e, shard))
            return False
        finally:
            dst.release()
        self._ok(shard)
        if not ok:
            self._corrupt(key)
            return False
        self.counters.bytes_out += dst.nbytes
        return True

    # --- remove --------------------------------------------------------
    def submit_remove(self, key: ChunkKey) -> bool:
        if not self._usable():
            return False
        return self._exec.submit(Priority.DELETE, self._delete_job, key) is not None

    async def _delete_job(self, key: ChunkKey) -> None:
        assert self._client is not None
        shard = self._shard(key)
        if not self._shard_allows(shard):
            return
        try:
            await self._client.delete(self._rkey(key, "m"), self._rkey(key, "d"))
        except self.faults as e:
            self._fault(self._tag(e, shard))

    # --- lifecycle -----------------------------------------------------
    async def _close_medium(self) -> None:
        if self._client is not None:
            await self._client.aclose()


class RedisTier(RedisStoreBase):
    """One Redis server: a blocking connection pool, optional TLS."""

    kind = "redis"
    options_type = RedisOptions
    _opts: RedisOptions

    def __init__(self, opts: RedisOptions, *, name: str = "redis", write_back: bool = False) -> None:
        super().__init__(opts, name=name, write_back=write_back)

    def _connect(self, tls: ssl.SSLContext | None) -> aioredis.Redis:
        o = self._opts
        pool = aioredis.BlockingConnectionPool(
            host=o.host, port=o.port, db=o.db, username=o.username, password=o.password,
            socket_timeout=o.socket_timeout_s, socket_connect_timeout=o.connect_timeout_s,
            max_connections=o.max_connections, timeout=o.socket_timeout_s,
            retry=Retry(NoBackoff(), 1),
            **({"connection_class": SharedContextSSLConnection, "shared_ssl_context": tls} if tls else {}),
        )
        return aioredis.Redis(connection_pool=pool)

    async def _probe(self) -> None:
        await self._client.ping()

    def _rkey(self, key: ChunkKey, part: str) -> str:
        return f"{self._opts.key_prefix}:{key.identity}:{key.name}:{part}"

    async def _mget_metas(self, rkeys: list[str]) -> list[bytes | None]:
        raw = await self._client.mget(rkeys)
        self._health.ok()
        return raw

    async def _close_medium(self) -> None:
        if self._client is not None:
            await self._client.aclose(close_connection_pool=True)
