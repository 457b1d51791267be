"""Two routers (FleetClients, as in two HTTP server processes) over the same
two engine subprocesses: each engine reports its queued work to every router
that follows its KV events (``LoadReport``), so a router sees the load the
other router put there, not only its own.

Router A knows only engine r0 and keeps it busy; router B, routing a new
prompt whose tie-break prefers r0, sends it to r1 because r0's reports show
A's work. Without the reports B would see two idle engines and pick r0.
"""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig
from kvstrata.fleet import FleetClient, Replica, remote_connector
from kvstrata.ipc.addresses import make_address
from kvstrata.ipc.launcher import spawn_engine
from kvstrata.ipc.protocol import Credentials
from kvstrata.router import RouterConfig
from kvstrata.types import EngineLoad, SamplingParams

CONFIG = EngineConfig(device="cpu", log_level="WARNING", model=ModelConfig(num_threads=1, max_model_len=512),
                      cache=CacheConfig(block_size=4, num_blocks=256, enable_kv_events=True))


@pytest.fixture
def engines():
    addrs = [make_address("ipc") for _ in range(2)]
    procs = [spawn_engine(CONFIG, a.url, Credentials.new(curve=False)) for a in addrs]
    yield [a.url for a in addrs]
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
    for a in addrs:
        a.cleanup()


async def open_router(urls: dict[str, str]) -> FleetClient:
    replicas = [Replica(name, "remote", remote_connector(url, timeout_s=60.0), address=url)
                for name, url in urls.items()]
    return await FleetClient.start(replicas, RouterConfig(load_skip_min_tokens=1e9), retry_interval_s=0.2,
                                   grace_s=60.0)


async def drain(fleet: FleetClient, prompt: list[int], params: SamplingParams) -> int:
    n = 0
    async for o in fleet.generate(prompt, params):
        n += len(o.new_token_ids)
    return n


async def test_a_router_sees_the_load_another_router_put_on_an_engine(engines):
    a = await open_router({"r0": engines[0]})
    b = await open_router({"r0": engines[0], "r1": engines[1]})
    try:
        # A prompt B would send to r0 when both engines look idle (the tie-break by its first block).
        prompt = next(p for p in ([i + 1] * 40 + list(range(100, 140)) for i in range(200))
                      if b.router.choose(b.router.hash_prompt(p), num_tokens=len(p)).replica == "r0")
        long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        busy = [asyncio.create_task(drain(a, [(37 * k + 7 * j) % 250 + 1 for j in range(200)], long))
                for k in range(6)]
        async with asyncio.timeout(60):  # B hears of A's work from r0's reports, not from its own dispatches
            while not (b.replicas["r0"].engine_load or EngineLoad()).num_running + \
                    (b.replicas["r0"].engine_load or EngineLoad()).num_waiting >= 3:
                await asyncio.sleep(0.01)
        assert b.replicas["r0"].running == 0 and b.counters.feed.load_reports > 0
        load0 = b.router.load("r0")
        assert load0.running_requests >= 3 and load0.queued_prefill_tokens >= 0
        d = b.router.choose(b.router.hash_prompt(prompt), num_tokens=len(prompt))
        assert d.replica == "r1", (d, load0)
        assert await drain(b, prompt, SamplingParams(temperature=0.0, max_tokens=4)) == 4
        assert b.counters.routed == {"r0": 0, "r1": 1}
        status = b.fleet_status()["replicas"]["r0"]
        assert status["engine_load"] is not None and status["running_requests"] == 0
        assert sum(await asyncio.gather(*busy)) == 6 * 60
        async with asyncio.timeout(10):  # r0 drained: its next report says so
            while b.router.load("r0").running_requests:
                await asyncio.sleep(0.01)
    finally:
        await a.aclose()
        await b.aclose()
