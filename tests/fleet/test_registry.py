"""kvstrata.fleet.registry against a real redis-server and a real 3-master
Redis Cluster on loopback: engines register, close, die without deleting
(their key expires), restart with a new epoch (seen by ``watch``), a
garbage value is skipped and counted, Redis going away and coming back.

Skipped without redis-server / redis-cli, failed instead with
KVSTRATA_REQUIRE_REDIS=1.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import msgspec
import pytest
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.io.io_helpers import RedisServer  # noqa: E402
from tests.io.redis_cluster import REDIS_BIN, REDIS_CLI, started_cluster  # noqa: E402

from kvstrata.fleet.registry import (  # noqa: E402
    EngineDirectory,
    EngineRecord,
    EngineRegistration,
    RegistryConfig,
    RegistryUnavailable,
)

pytestmark = pytest.mark.redis

FAST = dict(ttl_s=1.0, heartbeat_s=0.3)


def _need_redis() -> None:
    if REDIS_BIN is None or REDIS_CLI is None or shutil.which("redis-server") is None:
        if os.environ.get("KVSTRATA_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server / redis-cli not found and KVSTRATA_REQUIRE_REDIS=1")
        pytest.skip("redis-server / redis-cli not installed")


def redis_url(server: RedisServer) -> str:
    return f"redis://127.0.0.1:{server.port}/0"


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    _need_redis()
    s = RedisServer(tmp_path_factory.mktemp("redis-single"))
    s.start()
    yield s
    s.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    _need_redis()
    yield from started_cluster(tmp_path_factory.mktemp("redis-cluster"))


@pytest.fixture(params=["single", "cluster"])
def backend(request):
    """(url, a sync redis client for poking raw keys)."""
    if request.param == "single":
        s = request.getfixturevalue("single")
        client = redis.Redis(host="127.0.0.1", port=s.port)
        yield redis_url(s), client
    else:
        c = request.getfixturevalue("cluster")
        client = redis.RedisCluster(startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in c.startup_nodes])
        yield "redis-cluster://" + ",".join(f"{h}:{p}" for h, p in c.startup_nodes), client
    client.close()


_n = 0


def config(url: str, **kw) -> RegistryConfig:
    """A fresh fleet name per test, so tests sharing a server never see each other."""
    global _n
    _n += 1
    return RegistryConfig(url=url, fleet=f"t{os.getpid()}-{_n}", **kw)


def rec(engine_id: str, epoch: int, port: int = 5555) -> EngineRecord:
    return EngineRecord.here(engine_id, f"tcp://127.0.0.1:{port}", epoch, model="tiny")


async def kill9(reg: EngineRegistration) -> None:
    """An engine killed without deleting its key: the heartbeat stops, nothing else."""
    reg._task.cancel()
    await asyncio.gather(reg._task, return_exceptions=True)
    reg._task = None
    client, reg._client = reg._client, None
    await client.aclose()


async def wait_for(pred, timeout: float, step: float = 0.05):
    start = time.monotonic()
    while True:
        v = await pred()
        if v:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout}s")
        await asyncio.sleep(step)


class Watcher:
    """Collects ``directory.watch`` diffs from a background task."""

    def __init__(self, directory: EngineDirectory, interval_s: float) -> None:
        self.diffs: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._run(directory, interval_s))

    async def _run(self, directory, interval_s):
        async for diff in directory.watch(interval_s):
            await self.diffs.put(diff)

    async def next(self, timeout: float = 3.0):
        return await asyncio.wait_for(self.diffs.get(), timeout)

    async def close(self):
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


# --- membership -----------------------------------------------------------------------


async def test_two_engines_register_and_close_removes_one(backend):
    url, _ = backend
    cfg = config(url)
    async with EngineDirectory(cfg) as d:
        a = await EngineRegistration(cfg, rec("e0", 11, 5000)).start()
        async with EngineRegistration(cfg, rec("e1", 22, 5001)):
            m = await d.members()
            assert set(m) == {"e0", "e1"}
            assert m["e0"].address == "tcp://127.0.0.1:5000" and m["e0"].epoch == 11
            assert m["e1"].epoch == 22 and m["e1"].pid == os.getpid() and m["e1"].model == "tiny"
            await a.aclose()
            assert set(await d.members()) == {"e1"}
        assert await d.members() == {}


async def test_heartbeat_keeps_key_past_ttl_and_killed_engine_vanishes(backend):
    url, _ = backend
    cfg = config(url, **FAST)
    async with EngineDirectory(cfg) as d:
        reg = await EngineRegistration(cfg, rec("e0", 1)).start()
        await asyncio.sleep(cfg.ttl_s * 1.6)  # refreshed by the beats
        assert set(await d.members()) == {"e0"}
        await kill9(reg)

        async def gone():
            return "e0" not in await d.members()

        took = await wait_for(gone, cfg.ttl_s + 1.0)
        assert took <= cfg.ttl_s + 1.0


async def test_restart_new_epoch_seen_by_watch_and_older_engine_backs_off(backend):
    url, _ = backend
    cfg = config(url, **FAST)
    async with EngineDirectory(cfg) as d:
        w = Watcher(d, 0.1)
        try:
            first = await w.next()
            assert first.added == {} and not first.removed  # the initial (empty) membership
            old = await EngineRegistration(cfg, rec("e0", 1)).start()
            diff = await w.next()
            assert set(diff.added) == {"e0"} and diff.added["e0"].epoch == 1
            # The same id starts again (old still alive: a restart seen before the old key expired).
            new = await EngineRegistration(cfg, rec("e0", 2, 6000)).start()
            diff = await w.next()
            assert not diff.added and not diff.removed
            assert diff.changed_epoch["e0"].epoch == 2 and diff.changed_epoch["e0"].address.endswith(":6000")
            # The older engine keeps beating but never overwrites the newer epoch.
            await asyncio.sleep(cfg.heartbeat_s * 3)
            assert old.taken_over and not new.taken_over
            assert (await d.members())["e0"].epoch == 2
            await old.aclose()  # does not delete the newer record
            assert (await d.members())["e0"].epoch == 2
            await new.aclose()
            diff = await w.next()
            assert set(diff.removed) == {"e0"} and diff.removed["e0"].epoch == 2
            assert w.diffs.empty()
        finally:
            await w.close()


async def test_watch_hears_announcements_without_scanning(backend):
    """Registrations announce their writes and deletes on the registry's
    channel: a watcher whose full re-read is a minute away still sees an
    engine join, restart and leave at once, each by reading one key."""
    url, raw = backend
    cfg = config(url, scan_interval_s=60.0, **FAST)
    async with EngineDirectory(cfg) as d:
        w = Watcher(d, None)
        try:
            assert (await w.next()).added == {}
            reg = await EngineRegistration(cfg, rec("e0", 1)).start()
            diff = await w.next(timeout=2.0)
            assert set(diff.added) == {"e0"} and diff.added["e0"].epoch == 1
            new = await EngineRegistration(cfg, rec("e0", 2, 6000)).start()
            diff = await w.next(timeout=2.0)
            assert diff.changed_epoch["e0"].epoch == 2 and not diff.added and not diff.removed
            await reg.aclose()  # holds no longer its record: deletes nothing, announces nothing
            await new.aclose()
            diff = await w.next(timeout=2.0)
            assert set(diff.removed) == {"e0"}
            assert d.scans == 1 and d.announcements == 3  # one full read, at the start
            # A key written behind the registry's back (no announcement) waits for the next full read.
            raw.set(cfg.key("quiet"), msgspec.msgpack.encode(rec("quiet", 9)), px=20_000)
            await asyncio.sleep(0.5)
            assert w.diffs.empty() and "quiet" in await d.members()
            raw.delete(cfg.key("quiet"))
        finally:
            await w.close()


async def test_watch_finds_what_no_one_announced_at_its_full_reread(backend):
    """An engine killed without deleting its key announces nothing: its key
    expires and the watcher's periodic full read (the safety net) sees it gone."""
    url, _ = backend
    cfg = config(url, scan_interval_s=0.5, **FAST)
    async with EngineDirectory(cfg) as d:
        reg = await EngineRegistration(cfg, rec("e0", 1)).start()
        w = Watcher(d, None)
        try:
            assert set((await w.next()).added) == {"e0"}
            await kill9(reg)
            diff = await w.next(timeout=cfg.ttl_s + 2 * cfg.scan_interval_s + 1.0)
            assert set(diff.removed) == {"e0"}
            assert d.announcements == 0 and d.scans >= 2
        finally:
            await w.close()


async def test_garbage_value_is_skipped_and_counted(backend):
    url, raw = backend
    cfg = config(url)
    async with EngineDirectory(cfg) as d, EngineRegistration(cfg, rec("good", 7)):
        raw.set(cfg.key("junk"), b"\xc1 not msgpack", px=20_000)
        raw.set(cfg.key("liar"), b"\x81\xa1x\x01", px=20_000)  # msgpack, but not a record
        m = await d.members()
        assert set(m) == {"good"}
        assert d.undecodable == 2
        await d.members()
        assert d.undecodable == 4  # counted at every read while it stays there
        raw.delete(cfg.key("junk"), cfg.key("liar"))
        assert set(await d.members()) == {"good"} and d.undecodable == 4


async def test_cluster_members_span_every_master(cluster):
    url = "redis-cluster://" + ",".join(f"{h}:{p}" for h, p in cluster.startup_nodes)
    cfg = config(url)
    regs = [EngineRegistration(cfg, rec(f"e{i}", i)) for i in range(12)]
    async with EngineDirectory(cfg) as d:
        for r in regs:
            await r.start()
        try:
            owners = {cluster.master_of(r.key.encode()) for r in regs}
            assert owners == set(cluster.ports)  # the keys really live on all three masters
            assert set(await d.members()) == {f"e{i}" for i in range(12)}
        finally:
            for r in regs:
                await r.aclose()
        assert await d.members() == {}


# --- Redis down -------------------------------------------------------------------------


async def test_watch_and_heartbeat_ride_out_a_redis_restart(tmp_path):
    _need_redis()
    server = RedisServer(tmp_path)
    server.start()
    try:
        cfg = config(redis_url(server), **FAST)
        async with EngineDirectory(cfg) as d, EngineRegistration(cfg, rec("e0", 5)) as reg:
            w = Watcher(d, 0.1)
            try:
                assert set((await w.next()).added) == {"e0"}
                server.kill()  # everything lost: no persistence
                await asyncio.sleep(1.0)
                assert w.diffs.empty() and not w.task.done()  # nothing yielded, still watching
                assert reg.failures >= 2
                with pytest.raises(RegistryUnavailable, match=f"127.0.0.1:{server.port}"):
                    await d.members()
                server.start()  # same port, empty
                # The engine's next beat writes its key again (it was absent); watch resumes.
                await wait_for(lambda: _has(d, "e0"), 2.0)
                await asyncio.sleep(0.3)
                while not w.diffs.empty():
                    diff = w.diffs.get_nowait()
                    assert not diff.changed_epoch
                assert not w.task.done()
            finally:
                await w.close()
    finally:
        server.kill()


async def _has(d: EngineDirectory, engine_id: str) -> bool:
    try:
        return engine_id in await d.members()
    except RegistryUnavailable:
        return False


# --- errors ---------------------------------------------------------------------------


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="heartbeat_s"):
        RegistryConfig(url="redis://127.0.0.1:6379", ttl_s=1.0, heartbeat_s=1.0)
    with pytest.raises(ValueError, match="heartbeat_s"):
        RegistryConfig(url="redis://127.0.0.1:6379", ttl_s=1.0, heartbeat_s=2.0)
    with pytest.raises(ValueError, match="url"):
        RegistryConfig(url="http://127.0.0.1:6379")
    with pytest.raises(ValueError, match="url"):
        RegistryConfig(url="redis-cluster://127.0.0.1")
    with pytest.raises(ValueError, match="ttl_s"):
        RegistryConfig(url="redis://h:1", ttl_s=0.0)
    with pytest.raises(ValueError, match="fleet"):
        RegistryConfig(url="redis://h:1", fleet="a*")
    with pytest.raises(ValueError, match="engine_id"):
        EngineRegistration(RegistryConfig(url="redis://h:1"), rec("bad id", 1))
    cfg = RegistryConfig(url="redis-cluster://10.0.0.1:7000, 10.0.0.2:7001")
    assert cfg.cluster_nodes() == [("10.0.0.1", 7000), ("10.0.0.2", 7001)]
    cfg = RegistryConfig(url="rediss-cluster://10.0.0.1:7000?ssl_ca_certs=/ca.pem")
    assert cfg.cluster_nodes() == [("10.0.0.1", 7000)] and cfg.cluster_tls() == {"ssl_ca_certs": "/ca.pem"}
    with pytest.raises(ValueError, match="use rediss-cluster:// for TLS"):
        RegistryConfig(url="redis-cluster://10.0.0.1:7000?ssl_ca_certs=/ca.pem")
    with pytest.raises(ValueError, match="unknown or empty query argument 'ssl_ca'"):
        RegistryConfig(url="rediss-cluster://10.0.0.1:7000?ssl_ca=/ca.pem")
    with pytest.raises(ValueError, match="ssl_certfile and ssl_keyfile go together"):
        RegistryConfig(url="rediss-cluster://10.0.0.1:7000?ssl_certfile=/c.pem")
    assert cfg.key("e0") == "kvstrata:fleet:default:engine:e0"


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


@pytest.mark.parametrize("scheme", ["redis", "redis-cluster"])
async def test_unreachable_registry_names_the_url(scheme):
    url = f"{scheme}://127.0.0.1:{_dead_port()}"
    cfg = RegistryConfig(url=url)
    async with EngineDirectory(cfg) as d:
        with pytest.raises(RegistryUnavailable, match=url) as ei:
            await d.members()
        assert ei.value.url == url
    with pytest.raises(RegistryUnavailable, match=url):
        await EngineRegistration(cfg, rec("e0", 1)).start()


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    _need_redis()
    yield from started_cluster(tmp_path_factory.mktemp("redis-tls-cluster"), tls=True)


async def test_a_tls_cluster_registry_with_its_ca_and_without(tls_cluster):
    """``rediss-cluster://...?ssl_ca_certs=FILE``: engines register and are
    found over TLS; without the CA the system store refuses the self-signed
    certificate and the error names the registry; plain text gets nowhere."""
    nodes = ",".join(f"{h}:{p}" for h, p in tls_cluster.startup_nodes)
    cfg = config(f"rediss-cluster://{nodes}?ssl_ca_certs={tls_cluster.tls[0]}")
    async with EngineDirectory(cfg) as d, EngineRegistration(cfg, rec("e0", 5)):
        m = await d.members()
        assert set(m) == {"e0"} and m["e0"].epoch == 5
    for url in (f"rediss-cluster://{nodes}", f"redis-cluster://{nodes}"):
        with pytest.raises(RegistryUnavailable, match="fleet registry .* is unreachable"):
            await EngineRegistration(config(url), rec("e1", 1)).start()
