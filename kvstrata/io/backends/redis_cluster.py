"""L3: a Redis Cluster through ``redis.asyncio.cluster``.

The same objects, checksums and put/read logic as the single-server tier
(``redis.RedisStoreBase``); the object's name is the hash tag, so its two
keys share a slot (the data+meta pipeline and the read's MGET stay
single-slot)::

    {key_prefix}:{identity}:{{name}}:d   the payload bytes
    {key_prefix}:{identity}:{{name}}:m   msgpack [key, shape, dtype, layout, nbytes, xxh3_64]

Health is kept per master as well as for the tier: a master that fails
(refused connection, timeout) is marked down on its own, and its keys are
misses and its puts dropped without I/O until its retry time; the other
masters' keys keep hitting. After such a fault the slot map is refreshed
before the next request (a replica may have taken over). The tier itself
becomes unavailable when no node answers (the cluster is down, or
unreachable at start) or when every master is down. The client does not
retry by itself: the tier's health does the retrying. With ``ssl`` every
node is reached over TLS, verified as the single-server tier verifies.
"""

from __future__ import annotations

import asyncio
import ssl

import structlog
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    ClusterDownError,
    MaxConnectionsError,
    RedisClusterException,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
)

from kvstrata.io.backends.base import Health
from kvstrata.io.backends.redis import RedisStoreBase, ShardDown
from kvstrata.io.backends.redis_tls import SharedContextSSLConnection
from kvstrata.io.config import RedisClusterOptions
from kvstrata.io.keys import ChunkKey

log = structlog.get_logger(__name__)

# RedisClusterException (no node reachable, a slot not covered) is not a RedisError.
_FAULTS = (RedisError, RedisClusterException, OSError, asyncio.TimeoutError)


class RedisClusterTier(RedisStoreBase):
    """Owns: the cluster client and its per-node connections, one Health
    per master that has failed; the rest as RedisStoreBase."""

    kind = "redis-cluster"
    options_type = RedisClusterOptions
    faults = _FAULTS
    _opts: RedisClusterOptions

    def __init__(self, opts: RedisClusterOptions, *, name: str = "redis-cluster", write_back: bool = False) -> None:
        super().__init__(opts, name=name, write_back=write_back)
        self._shards: dict[str, Health] = {}
        self._refresh = False  # refresh the slot map before the next request

    def _connect(self, tls: ssl.SSLContext | None) -> RedisCluster:
        o = self._opts
        client = RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in o.nodes()],
            username=o.username, password=o.password,
            socket_timeout=o.socket_timeout_s, socket_connect_timeout=o.connect_timeout_s,
            max_connections=o.max_connections, require_full_coverage=False,
            retry=Retry(NoBackoff(), 0),
        )
        if tls is not None:
            # RedisCluster takes no connection class; its nodes are made from
            # the nodes manager's connection kwargs (the startup nodes already
            # were), where redis-py injects its own per-connection options too.
            client.nodes_manager.connection_kwargs.update(
                connection_class=SharedContextSSLConnection, shared_ssl_context=tls)
            for node in client.nodes_manager.startup_nodes.values():
                node.connection_class = SharedContextSSLConnection
                node.connection_kwargs["shared_ssl_context"] = tls
        return client

    async def _probe(self) -> None:
        await self._client.initialize()  # the slot map from any reachable node

    def _rkey(self, key: ChunkKey, part: str) -> str:
        return f"{self._opts.key_prefix}:{key.identity}:{{{key.name}}}:{part}"

    # --- shards ----------------------------------------------------------
    def _node(self, rkey: str) -> str | None:
        """The master that holds ``rkey`` by the client's slot map (None
        while the map is not known)."""
        try:
            node = self._client.get_node_from_key(rkey)
        except SlotNotCoveredError:
            return None
        return None if node is None else node.name

    def _shard(self, key: ChunkKey) -> str | None:
        return self._node(self._rkey(key, "m"))

    def _shard_allows(self, shard: str | None) -> bool:
        h = self._shards.get(shard) if shard is not None else None
        return h is None or h.allow()

    def _ok(self, shard: str | None) -> None:
        self._health.ok()
        h = self._shards.get(shard) if shard is not None else None
        if h is not None:
            h.ok()

    def _fault(self, e: BaseException) -> None:
        if isinstance(e, ShardDown):
            return  # skipped, already counted when the shard failed
        self.counters.faults += 1
        if isinstance(e, MaxConnectionsError):  # our own pool is busy, the node is fine
            return
        if isinstance(e, ResponseError) and not isinstance(e, ClusterDownError):
            return  # a refused command (OOM, ...), not a dead link
        node = getattr(e, "connection", None)
        shard = getattr(e, "kvstrata_shard", None) or (node.name if isinstance(node, ClusterNode) else None)
        if shard is None or isinstance(e, ClusterDownError):
            self._health.fault(e)  # no node answered, or the cluster says it is down
            return
        self._refresh = True
        h = self._shards.get(shard)
        if h is None:
            h = self._shards[shard] = Health(f"{self.name}@{shard}", self._opts.health)
        h.fault(e)
        primaries = {n.name for n in self._client.get_primaries()}
        if primaries and all(not self._shard_allows(p) for p in primaries):
            self._health.fault(e)

    async def _refresh_slots(self) -> None:
        """Re-read the slot map once after a node failed."""
        if self._refresh:
            await self._client.nodes_manager.initialize()
            self._refresh = False

    # --- requests ----------------------------------------------------------
    async def _mget_metas(self, rkeys: list[str]) -> list[bytes | None]:
        """One pipeline per master (an MGET per slot inside it), all at once;
        a master that fails or is down answers None for its keys."""
        await self._refresh_slots()
        await self._client.initialize()  # no-op once the slot map is known
        groups: dict[str | None, list[int]] = {}
        for i, rk in enumerate(rkeys):
            groups.setdefault(self._node(rk), []).append(i)
        out: list[bytes | None] = [None] * len(rkeys)
        live = [(shard, idx) for shard, idx in groups.items() if self._shard_allows(shard)]
        results = await asyncio.gather(
            *(self._client.mget_nonatomic([rkeys[i] for i in idx]) for _, idx in live),
            return_exceptions=True,
        )
        for (shard, idx), res in zip(live, results):
            if isinstance(res, BaseException):
                if not isinstance(res, self.faults):
                    raise res
                self._fault(self._tag(res, shard))
                continue
            self._ok(shard)
            for i, v in zip(idx, res):
                out[i] = v
        return out

    async def _write(self, key, obj) -> bool:
        await self._refresh_slots()
        return await super()._write(key, obj)

    async def _read_job(self, key, want, dst) -> bool:
        try:
            await self._refresh_slots()
        except self.faults as e:
            dst.release()
            self._fault(e)
            return False
        return await super()._read_job(key, want, dst)

    async def _close_medium(self) -> None:
        if self._client is not None:
            await self._client.aclose()
