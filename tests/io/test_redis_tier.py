"""L3 Redis tier against a real redis-server: round trips, namespacing,
password and TLS, the server down at start, killed mid-run and restarted,
and corrupt values."""

from __future__ import annotations

import asyncio
import shutil
import ssl

import pytest
import structlog
import structlog.testing
from io_helpers import IDENT, get_ids, key, put_all, put_pattern

from kvstrata.io import TierSpec
from tests.io.redis_cluster import self_signed_cert

pytestmark = pytest.mark.redis


def redis_spec(server, **kw) -> TierSpec:
    return TierSpec(type="redis", options=server.options(**kw))


def evict_l1(store, ids):
    for i in ids:
        assert store.l1.remove(key(i))


async def test_round_trip_and_namespaced_keys(make_store, redis_server):
    store = await make_store(tiers=[redis_spec(redis_server)])
    await put_all(store, [0, 1, 2])
    evict_l1(store, [0, 1, 2])
    assert await store.lookup([key(i) for i in range(4)]) == 3
    assert await get_ids(store, [0, 1, 2, 3]) == [0, 1, 2]
    r = store.stats().tier("redis")
    assert (r.hit_chunks, r.puts, r.bytes_in, r.bytes_out, r.available) == (3, 3, 3 * 8192, 3 * 8192, True)
    names = sorted(k.decode() for k in redis_server.client().keys("*"))
    assert names == sorted(f"kvstrata:{IDENT}:{key(i).name}:{p}" for i in range(3) for p in "dm")
    assert store.l1.contains(key(0))  # promoted


async def test_password_is_required_and_used(make_store, redis_factory):
    server = redis_factory("--requirepass", "s3cret")
    bad = await make_store(tiers=[TierSpec(type="redis", options=server.options(password="wrong"))])
    await put_all(bad, [0])
    assert not bad.stats().tier("redis").available
    good = await make_store(tiers=[redis_spec(server)])
    await put_all(good, [1])
    evict_l1(good, [1])
    assert await get_ids(good, [1]) == [1]


def _tls_server(redis_factory, tmp_path):
    """A TLS-only Redis with a self-signed certificate for 127.0.0.1 (which
    no system CA store trusts); returns (server, certificate path)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    crt, pem = self_signed_cert(tmp_path)
    server = redis_factory(start=False)
    server.extra = ["--port", "0", "--tls-port", str(server.port), "--tls-cert-file", str(crt),
                    "--tls-key-file", str(pem), "--tls-ca-cert-file", str(crt), "--tls-auth-clients", "no"]
    server.start()
    return server, crt


async def test_tls_connection(make_store, redis_factory, tmp_path):
    server, crt = _tls_server(redis_factory, tmp_path)
    store = await make_store(tiers=[redis_spec(server, ssl=True, ssl_ca_certs=str(crt))])
    await put_all(store, [0])
    evict_l1(store, [0])
    assert await get_ids(store, [0]) == [0]
    assert store.stats().tier("redis").available


async def test_tls_connections_share_the_tiers_one_context(make_store, redis_factory, tmp_path, monkeypatch):
    """The context (its CA store parsed) is built once, off the loop, at
    start; none per connection (redis-py's default, on the loop and inside
    the connect timeout: on a loaded host, concurrent connects time out)."""
    server, crt = _tls_server(redis_factory, tmp_path)
    store = await make_store(tiers=[redis_spec(server, ssl=True, ssl_ca_certs=str(crt))])
    built = []
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **kw: built.append(a) or real(*a, **kw))
    await put_all(store, [0, 1, 2, 3])
    evict_l1(store, [0, 1, 2, 3])
    assert await get_ids(store, [0, 1, 2, 3]) == [0, 1, 2, 3]  # reads at once: several connections
    assert built == []


async def test_unreadable_tls_files_are_a_config_error_at_start(make_store, tmp_path):
    with pytest.raises(ValueError, match="cannot load the TLS files"):
        await make_store(tiers=[TierSpec(type="redis", options=dict(
            port=1, ssl=True, ssl_ca_certs=str(tmp_path / "missing.pem")))])


async def test_tls_without_a_ca_verifies_against_the_system_store(make_store, redis_factory, tmp_path):
    server, _crt = _tls_server(redis_factory, tmp_path)
    store = await make_store(tiers=[redis_spec(server, ssl=True)])
    await put_all(store, [0])
    r = store.stats().tier("redis")
    assert not r.available and r.puts == 0  # the self-signed certificate is refused


async def test_tls_verification_is_skipped_only_when_asked_loudly(make_store, redis_factory, tmp_path):
    server, _crt = _tls_server(redis_factory, tmp_path)
    with structlog.testing.capture_logs() as logs:
        store = await make_store(tiers=[redis_spec(server, ssl=True, ssl_insecure_skip_verify=True)])
    assert any(e["event"] == "redis_tls_verification_disabled" and e["log_level"] == "warning"
               for e in logs)
    await put_all(store, [0])
    evict_l1(store, [0])
    assert await get_ids(store, [0]) == [0]


def test_skipping_verification_with_a_ca_is_a_config_error():
    from kvstrata.io.config import RedisOptions

    with pytest.raises(ValueError, match="ssl_insecure_skip_verify"):
        RedisOptions(ssl=True, ssl_ca_certs="/ca.pem", ssl_insecure_skip_verify=True).validate("tiers[0].options")


async def test_server_down_at_start_then_up(make_store, redis_factory):
    server = redis_factory(start=False)
    store = await make_store(tiers=[redis_spec(server)])
    assert not store.stats().tier("redis").available
    await put_all(store, [0])
    r = store.stats().tier("redis")
    assert r.dropped_puts == 1 and r.puts == 0
    assert await get_ids(store, [0]) == [0]  # L1 unaffected
    await server.astart()
    await asyncio.sleep(0.12)
    await put_all(store, [1])
    evict_l1(store, [1])
    assert await get_ids(store, [1]) == [1]
    assert store.stats().tier("redis").available


async def test_killed_mid_run_misses_then_restarted_hits(make_store, redis_server):
    store = await make_store(tiers=[redis_spec(redis_server)])
    await put_all(store, [0, 1])
    evict_l1(store, [0, 1])
    redis_server.kill()
    assert await store.lookup([key(0)]) == 0
    assert await get_ids(store, [0, 1]) == []
    await put_all(store, [2])
    r = store.stats().tier("redis")
    assert not r.available and r.faults >= 1 and r.dropped_puts == 1
    assert await get_ids(store, [2]) == [2]
    await redis_server.astart()  # same port, empty (no persistence)
    await asyncio.sleep(0.12)
    assert await get_ids(store, [0]) == []  # the data died with the server
    await put_all(store, [3])
    evict_l1(store, [3])
    assert await get_ids(store, [3]) == [3]
    assert store.stats().tier("redis").available


async def test_killed_with_io_in_flight_resolves_everything(make_store, redis_server):
    store = await make_store(cpu_objs=16, tiers=[redis_spec(redis_server, max_in_flight=2)])
    await put_all(store, [0, 1])
    evict_l1(store, [0, 1])
    for i in range(2, 12):  # queued and running writes
        put_pattern(store, i)
    reads = asyncio.create_task(store.get([key(0), key(1)]))
    await asyncio.sleep(0)
    redis_server.kill()
    objs = await reads  # whatever got through before the kill, never an exception
    assert len(objs) <= 2
    for o in objs:
        o.release()
    await store.drain()
    r = store.stats().tier("redis")
    assert r.puts + r.dropped_puts == 12 and not r.available
    assert await get_ids(store, list(range(2, 12))) == list(range(2, 12))  # L1 still has them


async def test_a_corrupt_value_is_a_counted_miss_and_deleted(make_store, redis_server):
    store = await make_store(tiers=[redis_spec(redis_server)])
    await put_all(store, [0, 1])
    evict_l1(store, [0, 1])
    c = redis_server.client()
    data_key = f"kvstrata:{IDENT}:{key(0).name}:d"
    raw = bytearray(c.get(data_key))
    raw[77] ^= 0xFF
    c.set(data_key, bytes(raw))
    c.set(f"kvstrata:{IDENT}:{key(1).name}:m", b"\x93garbage")
    assert await get_ids(store, [0]) == []
    assert await get_ids(store, [1]) == []
    await store.drain()
    assert store.stats().tier("redis").corrupt == 2
    assert c.exists(data_key) == 0


async def test_a_chunk_another_engine_stored_is_not_sent_again(make_store, redis_server):
    a = await make_store(tiers=[redis_spec(redis_server)])
    b = await make_store(tiers=[redis_spec(redis_server)])
    await put_all(a, [0])
    await put_all(b, [0, 1])
    assert (a.stats().tier("redis").puts, b.stats().tier("redis").puts) == (1, 1)
    evict_l1(b, [0])
    assert await get_ids(b, [0]) == [0]


async def test_two_identities_do_not_share_keys(make_store, redis_server):
    store = await make_store(tiers=[redis_spec(redis_server)])
    await put_all(store, [0])
    other = key(0, ident="fedcba9876543210fedcba9876543210")
    assert await store.lookup([other]) == 0


async def test_bad_redis_options_name_the_field(make_store, redis_server):
    with pytest.raises(ValueError, match=r"tiers\[0\].options"):
        await make_store(tiers=[TierSpec(type="redis", options=dict(port="x"))])
    with pytest.raises(ValueError, match="max_in_flight"):
        await make_store(tiers=[redis_spec(redis_server, max_in_flight=32, max_connections=4)])


async def test_lookups_come_back_to_a_recovered_tier(make_store, redis_server):
    """Half-open breaker on the lookup path: store A's lookups open the
    breaker on a dead server; once it is back (and the retry interval has
    passed) A's next lookup tries it again and finds what store B (another
    engine) wrote meanwhile; the tier is marked available again."""
    a = await make_store(tiers=[redis_spec(redis_server)])
    redis_server.kill()
    assert await a.lookup([key(7)]) == 0  # the fault opens the breaker
    assert not a.stats().tier("redis").available
    assert await a.lookup([key(7)]) == 0  # open: skipped, no wait on a dead server
    await redis_server.astart()
    b = await make_store(tiers=[redis_spec(redis_server)])
    await put_all(b, [7])
    await b.drain()
    await asyncio.sleep(0.12)  # past the retry interval: half-open
    assert await a.lookup([key(7)]) == 1
    assert a.stats().tier("redis").available
    assert await get_ids(a, [7]) == [7]
