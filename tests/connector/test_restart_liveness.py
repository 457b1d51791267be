"""An engine restarted over the same disk tier, with a small device pool and
every request's prefix on disk: the restarted engine's async loads park
requests that hold most of the pool, and it must still finish every request
(with the oracle's tokens) within a bound, serially or with async
scheduling (where a request that finds no room while a step is in flight
waits for it instead of preempting itself: two parked loads took turns at
that forever); the engine that was shut down under load fails its
in-flight requests cleanly."""

from __future__ import annotations

import asyncio

from conn_helpers import N, assert_stepped, disk_tier, offload_config, prompt

from kvstrata.enginecore import SamplingParams
from kvstrata.errors import EngineDeadError

PARAMS = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)


async def _tokens(engine, p):
    return [t async for out in engine.generate(p, PARAMS) for t in out.new_token_ids]


async def test_restart_over_the_same_disk_tier_finishes_everything(oracle, make_engine, tmp_path, stepping):
    disk = tmp_path / "disk"
    cfg = offload_config(load_mode="async", cpu_chunks=32, tiers=(disk_tier(disk),))
    prompts = [prompt(300 + i, 64) for i in range(4)]

    first = await make_engine(cfg, num_blocks=80, **stepping)
    assert await asyncio.gather(*(_tokens(first, p) for p in prompts)) == [oracle.greedy(p, N) for p in prompts]
    await first.flush_kv()
    # Under load again, then shut down mid-run: every in-flight request ends
    # (an abort or EngineDeadError), none hangs.
    more = [asyncio.create_task(_tokens(first, prompt(400 + i, 40))) for i in range(4)]
    await asyncio.sleep(0.05)
    await asyncio.wait_for(first.aclose(), 30)
    done = await asyncio.wait_for(asyncio.gather(*more, return_exceptions=True), 30)
    assert all(isinstance(r, (list, EngineDeadError)) for r in done), done

    # 64-token prompts: 16 blocks each loaded from disk, 18 needed to finish;
    # 32 usable blocks, so two loads parked together hold the whole pool and
    # neither can grow by itself (this hung before waiting requests gave
    # their blocks back).
    second = await make_engine(cfg, num_blocks=33, **stepping)
    got = await asyncio.wait_for(asyncio.gather(*(_tokens(second, p) for p in prompts)), 30)
    assert got == [oracle.greedy(p, N) for p in prompts]
    stats = await second.stats()
    assert stats.extra["connector.disk.hit_tokens"] > 0
    assert stats.extra["connector.async_loads"] > 0
    assert_stepped(second, stepping)
