"""The fleet for real: two engine subprocesses (the seeded tiny model) over
real ZMQ sockets, sharing a real 3-master Redis Cluster tier, behind a
FleetClient with the KV-aware router.

- a multi-turn workload gets the same greedy tokens as one in-process engine,
  and later turns hit the prefix cache of the replica they were routed to;
- a prefix computed on replica A is a hit on replica B through the cluster;
- ``kill -9`` of one engine mid-run: requests that had not streamed are
  retried elsewhere, ones that had end with an error naming the replica,
  nothing hangs, and nothing is routed to it one second later; the engine
  restarted at the same address has a new epoch and its old blocks are not
  credited;
- a router that restarts rebuilds its index from the engines' replay and
  routes a known prefix home again;
- a killed Redis master: zero wrong tokens.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from kvstrata.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
from kvstrata.errors import EngineDeadError
from kvstrata.fleet import FleetClient
from kvstrata.router import GPU
from kvstrata.types import SamplingParams
from tests.fleet.fleet_helpers import Engines, open_fleet
from tests.io.redis_cluster import RedisClusterProcs, started_cluster

pytestmark = pytest.mark.redis

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
MODEL = ModelConfig(num_threads=1, max_model_len=256)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from started_cluster(tmp_path_factory.mktemp("fleet-cluster"))


def fleet_engine_config(cluster: RedisClusterProcs, buffer_steps: int = 10_000) -> EngineConfig:
    tier = {"type": "redis-cluster", "name": "shared",
            "options": {"startup_nodes": [f"{h}:{p}" for h, p in cluster.startup_nodes],
                        "socket_timeout_s": 0.5, "connect_timeout_s": 0.5,
                        "health": {"retry_interval_s": 0.2, "max_retry_interval_s": 0.5}}}
    store = {"cpu": {"capacity_bytes": 1 << 20, "pin_memory": False}, "tiers": [tier], "close_timeout_s": 5.0}
    kvt = KVTransferConfig(connector="offload", options={"store": store, "chunk_size": 2 * BS,
                                                         "enable_events": True})
    return EngineConfig(device="cpu", log_level="WARNING", model=MODEL, kv_transfer=kvt,
                        cache=CacheConfig(block_size=BS, num_blocks=96, enable_kv_events=True,
                                          kv_events_buffer_steps=buffer_steps))


async def tokens(client, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], int]:
    out, cached = [], 0
    async for o in client.generate(prompt, params):
        out += o.new_token_ids
        cached = max(cached, o.num_cached_tokens)
    return out, cached


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of one in-process engine (no tiers), memoised per prompt."""
    from kvstrata.ipc.engines import start_async_engine

    memo: dict[tuple, list[int]] = {}

    async def ref(prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
        key = (tuple(prompt), params.max_tokens)
        if key not in memo:
            engine = await start_async_engine(EngineConfig(device="cpu", log_level="WARNING", model=MODEL,
                                                           cache=CacheConfig(block_size=BS, num_blocks=96)))
            try:
                memo[key] = (await tokens(engine, prompt, params))[0]
            finally:
                await engine.aclose()
        return memo[key]

    return ref


async def multi_turn(fleet: FleetClient, reference, conversations: int = 4, turns: int = 3, seed: int = 0):
    """Each conversation's turns run in order, conversations side by side;
    every turn's tokens must equal the reference engine's."""
    cached_later_turns = []

    async def one(c: int) -> None:
        history = [(seed * 97 + c * 31 + i) % 250 + 1 for i in range(12)]
        for turn in range(turns):
            got, cached = await tokens(fleet, history)
            assert got == await reference(history), f"conversation {c} turn {turn}"
            if turn:
                cached_later_turns.append(cached)
            history = history + got + [(c + turn) % 250 + 1, 3, 5]

    await asyncio.gather(*(one(c) for c in range(conversations)))
    return cached_later_turns


async def test_fleet_serves_like_one_engine_and_survives_a_replica_kill(cluster, reference):
    cluster.wait_ok()
    engines = Engines(fleet_engine_config(cluster), 2)
    fleet = None
    try:
        fleet = await open_fleet(engines)
        # 1. same tokens as one engine; later turns are routed to their prefix
        cached = await multi_turn(fleet, reference)
        assert sum(1 for c in cached if c >= 12 // BS * BS) >= len(cached) - 1, cached

        # 2. a prefix computed on r0 is a hit on r1 through the shared cluster tier
        r0, r1 = fleet.replicas["r0"].client, fleet.replicas["r1"].client
        p = [200 + i % 40 for i in range(40)]
        want = await reference(p)
        assert (await tokens(r0, p))[0] == want
        await r0.flush_kv()
        before = (await r1.stats()).extra.get("connector.shared.hit_tokens", 0)
        assert (await tokens(r1, p))[0] == want
        assert (await r1.stats()).extra.get("connector.shared.hit_tokens", 0) - before >= 32

        # 3. kill -9 r1 while requests run on both replicas
        long = SamplingParams(temperature=0.0, max_tokens=40)
        prompts = [[(7 * k + i) % 250 + 1 for i in range(16)] for k in range(6)]
        refs = [await reference(q, long) for q in prompts]
        results: list = [None] * len(prompts)
        started = [False] * len(prompts)

        async def run(k: int) -> None:
            got = []
            try:
                async for o in fleet.generate(prompts[k], long):
                    started[k] = True
                    got += o.new_token_ids
                results[k] = got
            except EngineDeadError as e:
                results[k] = e

        tasks = [asyncio.create_task(run(k)) for k in range(len(prompts))]
        deadline = time.monotonic() + 30
        while not any(started) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        epoch_before = fleet.replicas["r1"].epoch
        engines.kill(1)
        killed_at = time.monotonic()
        async with asyncio.timeout(60):
            await asyncio.gather(*tasks)
        for k, res in enumerate(results):
            if isinstance(res, EngineDeadError):
                assert "r1" in str(res) and "died while streaming" in str(res)
            else:
                assert res == refs[k]  # finished (retried when it had not streamed): right tokens
        assert any(not isinstance(r, EngineDeadError) for r in results)

        # 4. one second after the kill nothing goes to r1
        await asyncio.sleep(max(0.0, killed_at + 1.0 - time.monotonic()))
        routed_r1 = fleet.counters.routed["r1"]
        outs = await asyncio.gather(*(tokens(fleet, [k + 1] * 9) for k in range(8)))
        assert fleet.counters.routed["r1"] == routed_r1
        for k, (got, _) in enumerate(outs):
            assert got == await reference([k + 1] * 9)

        # 5. restarted at the same address: a new epoch, its old blocks fenced
        engines.start(1)
        async with asyncio.timeout(60):
            while not (fleet.replicas["r1"].up and fleet.replicas["r1"].epoch != epoch_before):
                await asyncio.sleep(0.05)
        assert fleet.router.index.epoch("r1") == fleet.replicas["r1"].epoch
        assert not fleet.router.index.held("r1", GPU)  # nothing of the dead engine is credited
        assert fleet.counters.replica_restarts >= 1

        # 6. a Redis master dies: misses and recompute, never wrong tokens
        cluster.kill(cluster.ports[0])
        await multi_turn(fleet, reference, seed=1)
    finally:
        if fleet is not None:
            await fleet.aclose()
        engines.close()
        for port in cluster.ports:
            if port not in cluster.procs:
                cluster.restart(port)
        cluster.wait_ok()


@pytest.mark.parametrize("buffer_steps", [10_000, 2], ids=["replay", "snapshot"])
async def test_a_restarted_router_rebuilds_its_index_and_routes_home(cluster, reference, buffer_steps):
    """With the whole stream in the engines' rings the new router replays it;
    with a ring of 2 batches it loads a snapshot of each engine's caches."""
    cluster.wait_ok()
    for port in cluster.ports:
        with redis.Redis(port=port) as r:
            r.flushall()
    engines = Engines(fleet_engine_config(cluster, buffer_steps), 2)
    try:
        fleet = await open_fleet(engines)
        prompts = [[(11 * k + i) % 250 + 1 for i in range(24)] for k in range(4)]
        homes = {}
        for k, p in enumerate(prompts):
            assert (await tokens(fleet, p))[0] == await reference(p)
            homes[k] = fleet.router.choose(fleet.router.hash_prompt(p), num_tokens=len(p)).replica
        await fleet.aclose()

        fleet = await open_fleet(engines)  # a new router: it knows nothing until the replays land
        async with asyncio.timeout(30):
            while fleet.router.index.counters.batches == 0 and fleet.counters.feed.kv_snapshots < 2:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        assert fleet.counters.feed.kv_snapshots == (2 if buffer_steps == 2 else 0)
        for k, p in enumerate(prompts):
            d = fleet.router.choose(fleet.router.hash_prompt(p), num_tokens=len(p))
            assert d.replica == homes[k] and d.device_hit_tokens >= 20, (k, d)
            got, cached = await tokens(fleet, p)
            assert got == await reference(p) and cached >= 20
        await fleet.aclose()
    finally:
        engines.close()
