"""/health tells the truth: an engine with work queued and no progress for
longer than scheduler.stall_timeout_s is "stalled" (503), recovers once it
progresses again, and an idle engine is healthy however long it idled."""

from __future__ import annotations

import asyncio

import aiohttp
from engine_fakes import FakeRunner, ScriptedConnector

from kvstrata.api_server.server import OpenAIServer, run_http_server
from kvstrata.ipc.addresses import free_port
from kvstrata.types import SamplingParams


async def _consume(engine, prompt, rid):
    return [o async for o in engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0), request_id=rid)]


async def test_a_load_that_never_lands_is_reported_stalled_over_http(start_engine):
    runner = FakeRunner()
    engine = await start_engine(runner, connector=ScriptedConnector(hits={"a": (8, True)}), stall_timeout_s=0.3)
    port = free_port()
    http = await run_http_server(OpenAIServer(engine, model_name="tiny"), "127.0.0.1", port)
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as s:
            await asyncio.sleep(0.5)  # idle for longer than the timeout: still healthy
            async with s.get("/health") as r:
                assert r.status == 200 and (await r.json())["status"] == "ok"
            task = asyncio.create_task(_consume(engine, list(range(10, 20)), "a"))
            await asyncio.sleep(0.1)
            assert (await engine.check_health()).healthy  # loading, within the timeout
            await asyncio.sleep(0.4)  # the load never lands: no step computes anything
            h = await engine.check_health()
            assert not h.healthy and h.status == "stalled" and h.num_unfinished == 1
            assert h.seconds_since_progress > 0.3
            async with s.get("/health") as r:
                body = await r.json()
                assert r.status == 503 and body["status"] == "stalled" and "no progress" in body["reason"]
            runner.finished_recving = ["a"]  # the load finally lands
            await asyncio.to_thread(engine.wakeup)
            outs = await task
            assert outs[-1].finished
            async with s.get("/health") as r:
                assert r.status == 200
    finally:
        await http.cleanup()


async def test_a_busy_engine_is_healthy(start_engine):
    engine = await start_engine(FakeRunner(delay_s=0.05), stall_timeout_s=0.3)
    tasks = [asyncio.create_task(_consume(engine, list(range(10 * i, 10 * i + 10)), f"r{i}")) for i in range(3)]
    for _ in range(5):
        await asyncio.sleep(0.1)
        assert (await engine.check_health()).healthy
    await asyncio.gather(*tasks)
