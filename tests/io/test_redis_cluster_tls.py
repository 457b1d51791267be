"""The Redis Cluster tier over TLS, against a real 3-master cluster that
speaks only TLS (clients and cluster bus) with a self-signed certificate:
objects round-trip over the masters when the tier is given the CA; without
it (the system store does not trust the certificate) or without TLS the
tier is unavailable and the store keeps serving from L1; contradictory TLS
options are errors that name the field."""

from __future__ import annotations

import ssl

import pytest
import redis
from io_helpers import IDENT, get_ids, key, put_all

from kvstrata.io import TierSpec
from kvstrata.io.config import RedisClusterOptions
from tests.io.redis_cluster import RedisClusterProcs, started_cluster

pytestmark = pytest.mark.redis

T = "redis-cluster"
HEALTH = dict(retry_interval_s=0.05, max_retry_interval_s=0.1)


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    yield from started_cluster(tmp_path_factory.mktemp("tls-cluster"), tls=True)


def spec(c: RedisClusterProcs, **kw) -> TierSpec:
    """The tier's own timeouts (connect 2 s, socket 5 s): the connect timeout
    covers the TLS handshake too (an RSA key exchange on both sides), which
    on a loaded host takes far longer than a plain TCP connect; the faults
    tested here (a refused certificate, plain text to a TLS port) are
    answered at once and never wait for a timeout."""
    opts = dict(startup_nodes=[f"{h}:{p}" for h, p in c.startup_nodes], health=HEALTH)
    opts.update(kw)
    return TierSpec(type=T, options=opts)


def evict_l1(store, ids):
    for i in ids:
        assert store.l1.remove(key(i))


async def test_round_trip_over_tls_with_the_ca(make_store, tls_cluster):
    ca = str(tls_cluster.tls[0])
    ids = list(range(10))
    store = await make_store(cpu_objs=16, tiers=[spec(tls_cluster, ssl=True, ssl_ca_certs=ca)])
    await put_all(store, ids)
    evict_l1(store, ids)
    assert await get_ids(store, ids) == ids
    t = store.stats().tier(T)
    assert (t.puts, t.hit_chunks, t.available) == (10, 10, True)
    owners = {tls_cluster.master_of(f"kvstrata:{IDENT}:{{{key(i).name}}}:m".encode()) for i in ids}
    assert len(owners) >= 2  # spread over the masters, each reached over TLS
    for port in owners:
        with redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=ca) as r:
            assert r.ping()


async def test_every_connection_shares_the_tiers_one_context(make_store, tls_cluster, monkeypatch):
    """Ten reads at once open several connections to each master; none
    builds a TLS context of its own (redis-py's default: the CA store parsed
    on the loop, inside the connect timeout, per connection; on a loaded
    host that blocked the loop for seconds and timed connects out)."""
    ca = str(tls_cluster.tls[0])
    ids = list(range(10))
    store = await make_store(cpu_objs=16, tiers=[spec(tls_cluster, ssl=True, ssl_ca_certs=ca)])
    built = []
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **kw: built.append(a) or real(*a, **kw))
    await put_all(store, ids)
    evict_l1(store, ids)
    assert await get_ids(store, ids) == ids
    assert built == []


async def test_without_the_ca_or_without_tls_the_tier_is_unavailable_and_l1_serves(make_store, tls_cluster):
    for opts in (dict(ssl=True), dict()):  # the system store refuses the certificate; plain text gets no answer
        store = await make_store(tiers=[spec(tls_cluster, **opts)])
        await put_all(store, [0])
        t = store.stats().tier(T)
        assert not t.available and t.puts == 0, opts
        assert await get_ids(store, [0]) == [0]


@pytest.mark.parametrize("opts, match", [
    (dict(ssl=True, ssl_ca_certs="/ca.pem", ssl_insecure_skip_verify=True), "ssl_insecure_skip_verify"),
    (dict(ssl_ca_certs="/ca.pem"), r"tiers\[0\].options.ssl is false but TLS files are given"),
    (dict(ssl=True, ssl_certfile="/c.pem"), "ssl_certfile and tiers\\[0\\].options.ssl_keyfile go together"),
])
def test_contradictory_tls_options_are_named(opts, match):
    with pytest.raises(ValueError, match=match):
        RedisClusterOptions(startup_nodes=("127.0.0.1:7000",), **opts).validate("tiers[0].options")
