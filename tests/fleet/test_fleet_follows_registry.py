"""Engines on "other machines" (`kvstrata engine --listen tcp:// --registry
redis-cluster://...` processes) join a router that follows the registry in
a real 3-master Redis Cluster; one that is killed leaves it when its key
expires, and comes back with a new epoch when restarted. A registry that is
down at start is a clear error; an engine started while it is down serves
and registers once it is back."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from kvstrata.errors import EngineDeadError
from kvstrata.fleet.discovery import follow_registry
from kvstrata.ipc import keyfile
from kvstrata.ipc.addresses import free_port
from kvstrata.router import RouterConfig
from kvstrata.types import SamplingParams
from tests.io.redis_cluster import RedisClusterProcs, started_cluster

pytestmark = pytest.mark.redis

TINY = ["--model", "random", "--cache.block-size", "4", "--cache.num-blocks", "64", "--model.num-threads", "1",
        "--model.max-model-len", "128"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from started_cluster(tmp_path_factory.mktemp("registry-cluster"))


def _url(cluster: RedisClusterProcs) -> str:
    return "redis-cluster://" + ",".join(f"{h}:{p}" for h, p in cluster.startup_nodes)


def _engine(cluster, keys, engine_id: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "KVSTRATA_LOG_LEVEL": "WARNING"}
    return subprocess.Popen([sys.executable, "-m", "kvstrata", "engine", "--listen", f"tcp://127.0.0.1:{port}",
                             "--credentials", str(keys), "--registry", _url(cluster), "--engine-id", engine_id,
                             *TINY], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _until(cond, timeout_s: float, what: str) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not cond():
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {timeout_s}s: {what}") from None


async def test_a_router_follows_engines_through_the_cluster_registry(cluster, tmp_path):
    cluster.wait_ok()
    keys = tmp_path / "engine.keys"
    keyfile.load_or_create(str(keys))
    creds = keyfile.load(str(keys)).for_client()
    procs = {"a": _engine(cluster, keys, "a", free_port())}
    fleet = None
    try:
        async with asyncio.timeout(60):  # "a" registered
            while True:
                try:
                    fleet = await follow_registry(_url(cluster), [], RouterConfig(), creds, interval_s=0.2)
                    break
                except EngineDeadError:
                    await asyncio.sleep(0.2)
        assert list(fleet.replicas) == ["a"]
        b_port = free_port()
        procs["b"] = _engine(cluster, keys, "b", b_port)
        await _until(lambda: "b" in fleet.replicas and fleet.replicas["b"].up, 60, "b joins")
        params = SamplingParams(temperature=0.0, max_tokens=2)
        for k in range(6):
            outs = [o async for o in fleet.generate([k + 1] * 10, params)]
            assert outs[-1].finished
        assert set(fleet.counters.routed) == {"a", "b"}
        epoch_b = fleet.replicas["b"].epoch

        os.kill(procs["b"].pid, signal.SIGKILL)
        procs["b"].wait(10)
        await _until(lambda: "b" not in fleet.router.live_replicas(), 1.0, "no route to b within 1 s")
        await _until(lambda: "b" not in fleet.replicas, 3.0 + 2.0, "b leaves when its key expires")
        outs = [o async for o in fleet.generate([9] * 10, params)]
        assert outs[-1].finished

        procs["b"] = _engine(cluster, keys, "b", b_port)
        await _until(lambda: "b" in fleet.replicas and fleet.replicas["b"].up, 60, "b is back")
        assert fleet.replicas["b"].epoch != epoch_b
    finally:
        if fleet is not None:
            await fleet.aclose()
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


async def test_a_registry_down_at_start_is_a_clear_error():
    port = free_port()  # nothing listens there
    with pytest.raises(EngineDeadError, match=f"registry unreachable.*127.0.0.1:{port}"):
        await follow_registry(f"redis-cluster://127.0.0.1:{port}", [], RouterConfig(), None)
