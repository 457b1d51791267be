"""Engine membership in Redis (one node or a Redis Cluster), so routers on
any machine find the engines of a fleet.

    reg = EngineRegistration(RegistryConfig(url="redis-cluster://10.0.0.1:7000,10.0.0.2:7000"),
                             EngineRecord.here("engine-0", "tcp://10.0.0.5:5555", epoch=info.epoch))
    async with reg: ...                                   # the engine serves meanwhile
    directory = EngineDirectory(config)
    await directory.members()                             # {engine_id: EngineRecord}
    async for added, removed, changed_epoch in directory.watch(): ...

One key per engine, ``{prefix}:{fleet}:engine:{engine_id}``, its value the
msgpack ``EngineRecord``, written with ``SET ... PX ttl`` and refreshed every
``heartbeat_s`` by an asyncio task: an engine that dies without deleting it
disappears within ``ttl_s``. No protocol of our own beyond that: plain keys,
SCAN (every master of a cluster), MGET, two one-key Lua scripts, and one
pub/sub channel, ``{prefix}:{fleet}:members``: the registering side
publishes its engine id there whenever it writes or deletes its key (not
at a refresh), and ``watch`` reads just that key when it hears one. A
publish can be lost (a watcher reconnecting, a key that expired because
its engine died), so ``watch`` also re-reads the whole membership every
``scan_interval_s`` (5 s) and after every (re)subscription: the safety net.

Ownership of a key (an engine id used twice): the engine that *starts* last
wins. ``start()`` writes unconditionally (a starting engine is the newest
epoch of its id); a heartbeat refreshes the key only while it holds our own
record or is absent (Redis restarted, or it expired while Redis was
unreachable), so a newer epoch is never overwritten: the older engine logs
``fleet_registration_taken_over`` (once per takeover) and keeps beating, and
comes back only if the key goes away. ``aclose()`` deletes the key only if
it still holds our record.

Failures: ``start()`` raises ``RegistryUnavailable`` (naming the URL) when
the first write fails; later heartbeats that fail are logged and retried on
the next beat, the engine keeps serving. ``EngineDirectory.members()`` raises
``RegistryUnavailable``; ``watch`` logs, yields nothing while Redis is down
(the last membership is kept, not reported removed) and resumes after.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple, Self
from urllib.parse import parse_qsl

import msgspec
import structlog
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError

log = structlog.get_logger(__name__)

_GLOB = set("*?[]\\")

# KEYS[1] the engine's key; ARGV[1] our record, ARGV[2] ttl in ms.
# 0: refreshed (ours), 1: written (was absent), 2: held by another record.
_REFRESH = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 0
end
if not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 2
"""

# 1: deleted (it held our record), 0: left alone.
_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class RegistryUnavailable(ConnectionError):
    """The registry's Redis could not be reached; ``url`` names it."""

    def __init__(self, url: str, cause: BaseException | None = None) -> None:
        detail = f": {type(cause).__name__}: {cause}" if cause is not None else ""
        super().__init__(f"fleet registry {url} is unreachable{detail}")
        self.url = url
        self.cause = cause


def _parse_hostport(item: str, field: str) -> tuple[str, int]:
    host, sep, port = item.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field}: {item!r} is not host:port")
    return host.strip("[]"), int(port)


_CLUSTER_SCHEMES = ("redis-cluster", "rediss-cluster")
_CLUSTER_TLS_ARGS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


class RegistryConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Where the fleet's membership lives. ``url``: ``redis://host:port[/db]``
    (also ``rediss://`` for TLS, ``unix://``) for one node, or
    ``redis-cluster://host:port,host:port,...`` for a cluster's startup
    nodes (``rediss-cluster://`` for TLS). A TLS URL verifies the server
    against the system's CA store, or against ``?ssl_ca_certs=FILE``
    (``&ssl_certfile=FILE&ssl_keyfile=FILE`` for a client certificate)."""

    url: str
    prefix: str = "kvstrata:fleet"
    fleet: str = "default"
    ttl_s: float = 3.0
    heartbeat_s: float = 1.0
    scan_interval_s: float = 5.0  # watch's full re-read, behind the channel's announcements
    password: str | None = None

    @property
    def scheme(self) -> str:
        return self.url.partition("://")[0] if "://" in self.url else ""

    def __post_init__(self) -> None:
        scheme = self.scheme
        if scheme in _CLUSTER_SCHEMES:
            if not self.cluster_nodes():
                raise ValueError(f"registry.url: no host:port in {self.url!r}")
            tls = self.cluster_tls()
            if tls and scheme == "redis-cluster":
                raise ValueError(f"registry.url: {', '.join(tls)} given for a plain-text cluster; "
                                 f"use rediss-cluster:// for TLS ({self.url!r})")
        elif scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"registry.url must be redis[s]://host:port[/db] or redis[s]-cluster://host:port,..., "
                             f"got {self.url!r}")
        for field in ("prefix", "fleet"):
            value = getattr(self, field)
            if not value or _GLOB & set(value) or any(c.isspace() for c in value):
                raise ValueError(f"registry.{field} must be non-empty, without spaces or glob characters "
                                 f"(*?[]\\), got {value!r}")
        if not self.ttl_s > 0:
            raise ValueError(f"registry.ttl_s must be > 0, got {self.ttl_s}")
        if not 0 < self.heartbeat_s < self.ttl_s:
            raise ValueError(f"registry.heartbeat_s must be > 0 and < ttl_s ({self.ttl_s}), got {self.heartbeat_s}")
        if not self.scan_interval_s > 0:
            raise ValueError(f"registry.scan_interval_s must be > 0, got {self.scan_interval_s}")

    def cluster_nodes(self) -> list[tuple[str, int]]:
        rest = self.url.partition("://")[2].partition("?")[0].split("/", 1)[0]
        return [_parse_hostport(i, "registry.url") for i in rest.split(",") if i.strip()]

    def cluster_tls(self) -> dict[str, str]:
        """The TLS files a cluster URL's query names (``ssl_ca_certs``,
        ``ssl_certfile``, ``ssl_keyfile``); any other query is an error."""
        query = self.url.partition("?")[2]
        out: dict[str, str] = {}
        for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
            if name not in _CLUSTER_TLS_ARGS or not value:
                raise ValueError(f"registry.url: unknown or empty query argument {name!r} (a cluster URL takes "
                                 f"{', '.join(_CLUSTER_TLS_ARGS)}), in {self.url!r}")
            out[name] = value
        if ("ssl_certfile" in out) != ("ssl_keyfile" in out):
            raise ValueError(f"registry.url: ssl_certfile and ssl_keyfile go together, in {self.url!r}")
        return out

    def key(self, engine_id: str) -> str:
        return f"{self.prefix}:{self.fleet}:engine:{engine_id}"

    @property
    def pattern(self) -> str:
        return f"{self.prefix}:{self.fleet}:engine:*"

    @property
    def channel(self) -> str:
        """Where registrations announce the engine id whose key they wrote or deleted."""
        return f"{self.prefix}:{self.fleet}:members"

    def connect(self) -> Redis | RedisCluster:
        """A new client (no connection is made until the first command).
        Short timeouts and no hidden retries: a beat that fails is retried
        at the next beat, not inside this one."""
        timeout = min(1.0, self.heartbeat_s)
        common: dict[str, Any] = dict(  # Any: redis-py's connection keywords
            password=self.password, socket_timeout=timeout, socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0))
        if self.scheme in _CLUSTER_SCHEMES:
            if self.scheme == "rediss-cluster":
                common.update(ssl=True, ssl_cert_reqs="required", **self.cluster_tls())
            return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self.cluster_nodes()],
                                require_full_coverage=False, **common)
        if self.password is None:
            common.pop("password")  # the URL's own password, if any
        return Redis.from_url(self.url, **common)


class EngineRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One engine as the registry holds it. ``epoch`` changes at every engine
    start (the handshake's epoch); ``model`` is informational."""

    engine_id: str
    address: str
    epoch: int
    pid: int
    host: str
    started_at: float
    model: str = ""

    @classmethod
    def here(cls, engine_id: str, address: str, epoch: int, model: str = "") -> EngineRecord:
        """A record for an engine in this process."""
        return cls(engine_id=engine_id, address=address, epoch=epoch, pid=os.getpid(),
                   host=socket.gethostname(), started_at=time.time(), model=model)


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(EngineRecord).decode

_UNREACHABLE = (RedisError, RedisClusterException, OSError, asyncio.TimeoutError)


def _reraise_if_cancelled(error: BaseException | None = None) -> None:
    """A cancellation that lands inside a redis-py command is sometimes
    swallowed (seen under load: the command returns or fails, and the task's
    cancel request is still pending); a loop that was asked to stop must
    stop, not carry on. Called after every Redis call in the loops."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError() from error


async def _close_quietly(pubsub: Any) -> None:  # Any: redis-py's PubSub or ClusterPubSub
    """Close a subscription whose connection may be broken already."""
    try:
        await pubsub.aclose()
    except _UNREACHABLE:
        pass


async def _close(client: Redis | RedisCluster) -> None:
    if isinstance(client, RedisCluster):
        await client.aclose()
    else:
        await client.aclose(close_connection_pool=True)


class EngineRegistration:
    """Owns: one engine's key (written at start, refreshed every
    ``heartbeat_s``, deleted at close if still ours), the heartbeat task and
    its Redis client."""

    def __init__(self, config: RegistryConfig, record: EngineRecord) -> None:
        if not record.engine_id or _GLOB & set(record.engine_id) or any(c.isspace() for c in record.engine_id):
            raise ValueError(f"engine_id must be non-empty, without spaces or glob characters, "
                             f"got {record.engine_id!r}")
        self.config = config
        self.record = record
        self.key = config.key(record.engine_id)
        self._value = _encode(record)
        self._ttl_ms = max(1, int(config.ttl_s * 1000))
        self._client: Redis | RedisCluster | None = None
        self._task: asyncio.Task[None] | None = None
        self.taken_over = False  # the key holds another record (a newer start of this id)
        self.failures = 0  # beats that could not reach Redis

    async def start(self) -> Self:
        """Write the record (overwriting an older start of this id) and start
        beating. Raises ``RegistryUnavailable`` if Redis cannot be reached."""
        if self._task is not None:
            raise RuntimeError("registration already started")
        self._client = self.config.connect()
        try:
            await self._client.set(self.key, self._value, px=self._ttl_ms)
        except _UNREACHABLE as e:
            client, self._client = self._client, None
            await _close(client)
            raise RegistryUnavailable(self.config.url, e) from e
        await self._announce(self._client)
        self._task = asyncio.get_running_loop().create_task(
            self._beat(), name=f"kvstrata-registry-{self.record.engine_id}")
        log.info("fleet_registered", key=self.key, engine_id=self.record.engine_id, epoch=self.record.epoch,
                 address=self.record.address, url=self.config.url)
        return self

    async def _beat(self) -> None:
        assert self._client is not None
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            try:
                res = await self._client.eval(_REFRESH, 1, self.key, self._value, self._ttl_ms)
            except _UNREACHABLE as e:
                _reraise_if_cancelled(e)
                self.failures += 1
                log.warning("fleet_registration_refresh_failed", key=self.key, url=self.config.url,
                            error=f"{type(e).__name__}: {e}")
                continue
            _reraise_if_cancelled()
            if res == 2:
                if not self.taken_over:
                    log.error("fleet_registration_taken_over", key=self.key, engine_id=self.record.engine_id,
                              epoch=self.record.epoch,
                              hint="another engine started with this id; ours returns only if its key goes away")
                self.taken_over = True
            else:
                if res == 1:
                    log.info("fleet_registration_rewritten", key=self.key, epoch=self.record.epoch)
                    await self._announce(self._client)
                self.taken_over = False

    async def _announce(self, client: Redis | RedisCluster) -> None:
        """Tell watchers our key changed (they read it). A lost announcement
        costs only time: their periodic full read finds the key."""
        try:
            await client.publish(self.config.channel, self.record.engine_id)
        except _UNREACHABLE as e:
            _reraise_if_cancelled(e)
            log.warning("fleet_registration_announce_failed", key=self.key, url=self.config.url,
                        error=f"{type(e).__name__}: {e}")

    async def aclose(self) -> None:
        """Stop beating and delete the key if it still holds our record
        (a failure to reach Redis is logged: the key then expires)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        client, self._client = self._client, None
        if client is None:
            return
        try:
            if await client.eval(_DELETE, 1, self.key, self._value):
                await self._announce(client)
        except _UNREACHABLE as e:
            log.warning("fleet_unregister_failed", key=self.key, url=self.config.url,
                        error=f"{type(e).__name__}: {e}", note=f"the key expires within {self.config.ttl_s}s")
        finally:
            await _close(client)
        log.info("fleet_unregistered", key=self.key, epoch=self.record.epoch)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class MembershipDiff(NamedTuple):
    added: dict[str, EngineRecord]
    removed: dict[str, EngineRecord]  # the last record seen of each
    changed_epoch: dict[str, EngineRecord]  # the new record (the engine restarted)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed_epoch)


def diff_members(old: dict[str, EngineRecord], new: dict[str, EngineRecord]) -> MembershipDiff:
    return MembershipDiff(
        added={k: r for k, r in new.items() if k not in old},
        removed={k: r for k, r in old.items() if k not in new},
        changed_epoch={k: r for k, r in new.items() if k in old and old[k].epoch != r.epoch},
    )


class EngineDirectory:
    """Owns: one Redis client reading the fleet's members, and (while
    ``watch`` runs) one subscription to the registry's channel.
    ``undecodable`` counts values under the prefix that were skipped (not a
    record, or one whose engine_id does not match its key), over all reads;
    ``scans`` the full reads, ``announcements`` the engine ids heard on the
    channel."""

    def __init__(self, config: RegistryConfig) -> None:
        self.config = config
        self._client: Redis | RedisCluster | None = None
        self.undecodable = 0
        self.scans = 0
        self.announcements = 0
        self._bad_keys: set[str] = set()  # logged once while they stay bad

    def _conn(self) -> Redis | RedisCluster:
        if self._client is None:
            self._client = self.config.connect()
        return self._client

    async def members(self) -> dict[str, EngineRecord]:
        """Every registered engine, by id. Raises ``RegistryUnavailable``."""
        client = self._conn()
        prefix_len = len(self.config.key(""))
        try:
            keys = [k async for k in client.scan_iter(match=self.config.pattern, count=512)]
            if isinstance(client, RedisCluster):
                values = await client.mget_nonatomic(keys) if keys else []
            else:
                values = await client.mget(keys) if keys else []
        except _UNREACHABLE as e:
            _reraise_if_cancelled(e)
            # The client is kept (watch and other callers may be using it):
            # redis-py reconnects, and a cluster client reloads its slot map.
            raise RegistryUnavailable(self.config.url, e) from e
        self.scans += 1
        out: dict[str, EngineRecord] = {}
        bad: set[str] = set()
        for raw_key, value in zip(keys, values):
            key = raw_key.decode(errors="replace") if isinstance(raw_key, bytes) else str(raw_key)
            record = self._record(key[prefix_len:], value, key, bad)
            if record is not None:
                out[record.engine_id] = record
        self._bad_keys = bad
        return out

    async def member(self, engine_id: str) -> EngineRecord | None:
        """One engine's record, None when it is not registered (or its
        value is bad). Raises ``RegistryUnavailable``."""
        key = self.config.key(engine_id)
        try:
            value = await self._conn().get(key)
        except _UNREACHABLE as e:
            _reraise_if_cancelled(e)
            raise RegistryUnavailable(self.config.url, e) from e
        bad: set[str] = set()
        record = self._record(engine_id, value, key, bad)
        self._bad_keys = (self._bad_keys - {key}) | bad
        return record

    def _record(self, engine_id: str, value: bytes | None, key: str, bad: set[str]) -> EngineRecord | None:
        if value is None:
            return None  # expired between SCAN and MGET, or gone
        try:
            record = _decode(value)
            if record.engine_id != engine_id:
                raise ValueError(f"record names engine {record.engine_id!r}")
        except (msgspec.DecodeError, ValueError) as e:
            self.undecodable += 1
            bad.add(key)
            if key not in self._bad_keys:
                log.warning("fleet_registry_bad_value", key=key, error=str(e), skipped=True)
            return None
        return record

    async def _subscribe(self) -> Any:
        """A subscription to the registry's channel (a cluster delivers a
        publish to every node, so any node will do)."""
        client = self._conn()
        if isinstance(client, RedisCluster):
            await client.initialize()  # its slot map, to pick a node for the subscription
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(self.config.channel)
        except BaseException:
            await pubsub.aclose()
            raise
        return pubsub

    async def watch(self, interval_s: float | None = None) -> AsyncIterator[MembershipDiff]:
        """First the whole membership (as ``added``, possibly empty), then
        each non-empty change: an engine id announced on the registry's
        channel is read at once; the whole membership is read again every
        ``interval_s`` (default ``scan_interval_s``) and after every
        (re)subscription, for what no announcement told (keys that expired,
        announcements lost). While Redis is unreachable: log, yield nothing,
        keep the last membership, retry every ``interval_s`` at most."""
        interval = self.config.scan_interval_s if interval_s is None else interval_s
        known: dict[str, EngineRecord] | None = None
        pubsub: Any = None  # Any: redis-py's PubSub or ClusterPubSub
        down = False
        next_scan = 0.0
        try:
            while True:
                try:
                    if pubsub is None:
                        pubsub = await self._subscribe()  # before the full read: nothing falls between
                        next_scan = 0.0
                    now = time.monotonic()
                    if now >= next_scan:
                        next_scan = now + interval
                        fresh = await self.members()
                        _reraise_if_cancelled()
                        update = fresh
                    else:
                        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=next_scan - now)
                        _reraise_if_cancelled()
                        if msg is None or msg.get("type") != "message":
                            continue
                        self.announcements += 1
                        engine_id = bytes(msg["data"]).decode(errors="replace")
                        record = await self.member(engine_id)
                        _reraise_if_cancelled()
                        update = dict(known or {})
                        if record is None:
                            update.pop(engine_id, None)
                        else:
                            update[engine_id] = record
                except (RegistryUnavailable, *_UNREACHABLE) as e:
                    _reraise_if_cancelled(e)
                    if not down:
                        log.warning("fleet_registry_unreachable", url=self.config.url, error=str(e))
                    down = True
                    if pubsub is not None:
                        stale, pubsub = pubsub, None
                        await _close_quietly(stale)
                    await asyncio.sleep(min(interval, self.config.heartbeat_s))
                    continue
                if down:
                    log.info("fleet_registry_back", url=self.config.url)
                down = False
                diff = diff_members(known or {}, update)
                first, known = known is None, update
                if first or diff:
                    yield diff
        finally:
            if pubsub is not None:
                await _close_quietly(pubsub)

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await _close(client)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
