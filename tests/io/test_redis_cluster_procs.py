"""The loopback Redis Cluster the cluster-tier tests stand on: keys spread
over all masters, a killed master takes only its slots away, a restarted one
brings them back."""

from __future__ import annotations

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster

from tests.io.redis_cluster import REDIS_BIN, REDIS_CLI, RedisClusterProcs

pytestmark = [pytest.mark.redis, pytest.mark.skipif(REDIS_BIN is None or REDIS_CLI is None, reason="needs redis-server and redis-cli")]


@pytest.fixture
def cluster(tmp_path):
    c = RedisClusterProcs(tmp_path)
    c.start()
    yield c
    c.stop()


def test_cluster_spreads_keys_and_survives_a_killed_master(cluster):
    client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in cluster.startup_nodes], socket_timeout=1.0)
    try:
        keys = [f"k{i}".encode() for i in range(60)]
        for k in keys:
            client.set(k, k * 2)
        owners = {cluster.master_of(k) for k in keys}
        assert owners == set(cluster.ports)  # every master holds some
        dead = cluster.ports[0]
        cluster.kill(dead)
        alive = [k for k in keys if cluster.master_of(k) != dead]
        assert alive and all(client.get(k) == k * 2 for k in alive)
        lost = next(k for k in keys if cluster.master_of(k) == dead)
        with pytest.raises(redis.RedisError):
            client.get(lost)
    finally:
        client.close()
    cluster.restart(dead)
    cluster.wait_ok()
    client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in cluster.startup_nodes])
    try:
        client.set(lost, b"back")
        assert client.get(lost) == b"back"
    finally:
        client.close()
