"""Honest health and metrics of a fleet, over real HTTP in front of real
engine subprocesses: with one of two engines killed /health is 200
"degraded" naming it; with none left it is 503 "dead" (remote engines:
nobody is starting them) or "starting" (a local engine being restarted);
/metrics has ``kvstrata_replica_up`` per replica, keeps counters summed,
and never sums a ratio or a flag across replicas."""

from __future__ import annotations

import asyncio
import os
import signal

from aiohttp.test_utils import TestClient, TestServer

from kvstrata.api_server.metrics import parse_metrics, stats_from_metrics
from kvstrata.api_server.server import OpenAIServer
from kvstrata.fleet import FleetClient, Replica, local_connector
from kvstrata.fleet.stats import fleet_totals, is_additive
from kvstrata.types import EngineStats, SamplingParams
from tests.fleet.fleet_helpers import Engines, open_fleet, tiny_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


async def _until(cond, timeout_s: float, what: str) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not cond():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not within {timeout_s}s: {what}") from None


async def _page(http: TestClient) -> dict[tuple[str, str | None], float]:
    r = await http.get("/metrics")
    assert r.status == 200
    return {(name, labels.get("replica")): v for name, labels, v in parse_metrics(await r.text())}


def test_fleet_totals_sum_counters_and_never_ratios_or_flags():
    a = EngineStats(kv_usage=0.9, num_finished=3, prefix_cache_hits=40,
                    extra={"kv.num_blocks": 100.0, "store.cpu.available": 1.0, "store.cpu.hit_tokens": 8.0,
                           "store.cpu.reads": 4.0, "store.cpu.read_failures": 1.0, "store.cpu.read_failure_rate": 0.25,
                           "store.cpu.read_bandwidth_bps": 1e9, "connector.recompute_s_per_token": 0.001})
    b = EngineStats(kv_usage=0.5, num_finished=2, prefix_cache_hits=2,
                    extra={"kv.num_blocks": 300.0, "store.cpu.available": 1.0, "store.cpu.hit_tokens": 4.0,
                           "store.cpu.reads": 6.0, "store.cpu.read_failures": 0.0, "store.cpu.read_failure_rate": 0.0,
                           "store.cpu.read_bandwidth_bps": 2e9, "connector.recompute_s_per_token": 0.002})
    t = fleet_totals({"a": a, "b": b})
    assert t.kv_usage == (0.9 * 100 + 0.5 * 300) / 400  # 0.6, not 1.4
    assert (t.num_finished, t.prefix_cache_hits) == (5, 42)
    assert t.extra == {"kv.num_blocks": 400.0, "store.cpu.hit_tokens": 12.0, "store.cpu.reads": 10.0,
                       "store.cpu.read_failures": 1.0, "store.cpu.read_failure_rate": 0.1}
    assert not any(is_additive(k) for k in ("store.cpu.available", "spec.acceptance_rate.pos0",
                                            "spec.mean_accepted_length", "connector.step_overhead_s",
                                            "scheduler.cache_aware.max_skips_observed",
                                            "store.redis-cluster.read_latency_s"))
    assert all(is_additive(k) for k in ("store.redis-cluster.hit_tokens", "connector.cpu.load_s",
                                        "kv.num_free_blocks", "engine.given_chains"))


async def test_one_engine_down_is_degraded_and_none_up_is_dead():
    engines = Engines(tiny_config(num_blocks=48, cpu_store=True), 2)
    fleet = None
    try:
        fleet = await open_fleet(engines, policy="round-robin")
        async with TestClient(TestServer(OpenAIServer(fleet).make_app())) as http:
            r = await http.get("/health")
            assert (r.status, await r.json()) == (200, {"status": "ok"})
            for k in range(4):
                [o async for o in fleet.generate([k + 1] * 30, GREEDY)]
            page = await _page(http)
            assert page[("kvstrata_replica_up", "r0")] == page[("kvstrata_replica_up", "r1")] == 1.0
            # A flag is a series per replica, never a sum (it read 2.0).
            assert page[("kvstrata_store_cpu_available", "r0")] == page[("kvstrata_store_cpu_available", "r1")] == 1.0
            assert ("kvstrata_store_cpu_available", None) not in page
            # KV usage: the fleet's blocks in use over its blocks, from each replica's.
            u0, u1 = (page[("kvstrata_replica_kv_cache_usage_ratio", r)] for r in ("r0", "r1"))
            assert page[("kvstrata_kv_cache_usage_ratio", None)] == (u0 * 48 + u1 * 48) / 96 <= 1.0
            # Counters stay summed: 4 requests, 2 on each replica.
            assert page[("kvstrata_requests_finished_total", None)] == 4
            assert page[("kvstrata_engine_given_chains", None)] == 4
            back = stats_from_metrics((await (await http.get("/metrics")).text()))
            assert back.num_finished == 4 and "replica_up" not in back.extra

            engines.kill(1)
            await _until(lambda: not fleet.replicas["r1"].live, 5.0, "r1 marked down")
            r = await http.get("/health")
            body = await r.json()
            assert r.status == 200 and body["status"] == "degraded" and body["replicas_down"] == ["r1"]
            page = await _page(http)
            assert (page[("kvstrata_replica_up", "r0")], page[("kvstrata_replica_up", "r1")]) == (1.0, 0.0)
            assert ("kvstrata_store_cpu_available", "r1") not in page  # no stats from a dead replica
            assert page[("kvstrata_requests_finished_total", None)] == 2  # what the live replica counts

            engines.kill(0)
            await _until(lambda: not fleet.replicas["r0"].live, 5.0, "r0 marked down")
            r = await http.get("/health")
            body = await r.json()
            assert r.status == 503 and body["status"] == "dead" and body["replicas_down"] == ["r0", "r1"]
            page = await _page(http)  # still a page: which replicas serve (none)
            assert page == {("kvstrata_replica_up", "r0"): 0.0, ("kvstrata_replica_up", "r1"): 0.0} | {
                k: v for k, v in page.items() if not k[0].startswith("kvstrata_replica")}
            assert not any(k[0] == "kvstrata_requests_finished_total" for k in page)
    finally:
        if fleet is not None:
            await fleet.aclose()
        engines.close()


async def test_a_local_engine_being_restarted_is_starting_then_ok():
    fleet = await FleetClient.start([Replica("a", "local", local_connector(tiny_config()))], retry_interval_s=0.2)
    try:
        async with TestClient(TestServer(OpenAIServer(fleet).make_app())) as http:
            pid = fleet.replicas["a"].client.info.pid
            os.kill(pid, signal.SIGKILL)
            await _until(lambda: not fleet.replicas["a"].live, 5.0, "a marked down")
            r = await http.get("/health")
            body = await r.json()
            assert r.status == 503 and body["status"] == "starting" and body["replicas_down"] == ["a"]
            await _until(lambda: fleet.replicas["a"].live, 120.0, "a restarted")
            r = await http.get("/health")
            assert (r.status, await r.json()) == (200, {"status": "ok"})
            assert fleet.replicas["a"].num_starts == 2 and fleet.counters.replica_restarts == 1
            outs = [o async for o in fleet.generate([1, 2, 3, 4, 5], GREEDY)]
            assert outs[-1].finished
    finally:
        await fleet.aclose()


async def test_a_death_a_request_sees_reaches_the_router_at_once_and_the_replica_comes_back():
    """Liveness lives in the Replica and is pushed to the router when it
    changes: with the supervisor's look an hour away, a request that finds
    r1 dead takes it out of the router's live set before it returns (and is
    served by r0), and bringing r1 back starts at once: restarted at its
    address, it serves again with no supervisor tick."""
    engines = Engines(tiny_config(), 2)
    fleet = None
    try:
        fleet = await open_fleet(engines, policy="round-robin", check_interval_s=3600.0)
        engines.kill(1)
        for k in range(2):  # round-robin: one of the two is sent to r1 first
            outs = [o async for o in fleet.generate([k + 1] * 9, GREEDY)]
            assert outs[-1].finished
        assert fleet.router.live_replicas() == ["r0"] and not fleet.replicas["r1"].live
        assert fleet.counters.routed["r1"] <= 1 and fleet.counters.replica_deaths == 1
        epoch = fleet.replicas["r1"].epoch
        engines.start(1)
        await _until(lambda: fleet.replicas["r1"].live, 60.0, "r1 back without the supervisor")
        assert fleet.router.live_replicas() == ["r0", "r1"] and fleet.replicas["r1"].epoch != epoch
        for k in range(2):
            outs = [o async for o in fleet.generate([k + 3] * 9, GREEDY)]
            assert outs[-1].finished
        assert fleet.counters.routed["r1"] >= 1
    finally:
        if fleet is not None:
            await fleet.aclose()
        engines.close()


async def test_a_death_no_request_sees_is_pushed_by_the_client_not_found_by_polling():
    """MPEngineClient.on_dead: the connection's monitor sees r1's engine go,
    and the fleet hears it at once (the supervisor's look is an hour away)."""
    engines = Engines(tiny_config(), 2)
    fleet = None
    try:
        fleet = await open_fleet(engines, policy="round-robin", check_interval_s=3600.0)
        engines.kill(1)
        await _until(lambda: not fleet.replicas["r1"].live, 20.0, "r1 down with no request and no supervisor tick")
        assert fleet.router.live_replicas() == ["r0"] and fleet.counters.replica_deaths == 1
        outs = [o async for o in fleet.generate([7] * 9, GREEDY)]
        assert outs[-1].finished and fleet.counters.routed["r1"] == 0
    finally:
        if fleet is not None:
            await fleet.aclose()
        engines.close()
