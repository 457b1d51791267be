"""Asynchronous loading (WAITING_FOR_REMOTE_KVS without holding anyone up),
promotion before a synchronous load, and offload on preemption (with steps
run serially or overlapped) — against the HF oracle."""

from __future__ import annotations

import asyncio

from conn_helpers import (N, add, assert_stepped, disk_tier, offload_config, prompt, run_until_idle,
                          seed_lower_tiers, step)

from kvstrata.connector import OffloadMetadata
from kvstrata.enginecore import RequestStatus, SamplingParams


async def test_an_async_load_waits_without_holding_up_others(oracle, make_core):
    core = await make_core(offload_config(load_mode="async"))
    p, q = prompt(20, 70), prompt(21, 12)
    outputs: dict[str, list[int]] = {}
    add(core, "seed", p)
    await run_until_idle(core, outputs)
    assert core.reset_prefix_cache()
    add(core, "b", q)
    add(core, "a", p)
    so = await step(core, outputs)
    a = core.scheduler.requests["a"]
    assert so.num_scheduled_tokens == {"b": 12}
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS and core.kv.has_request("a")
    so = await step(core, outputs)  # b decodes; the worker scatters a's chunks
    assert so.num_scheduled_tokens == {"b": 1}
    meta = so.kv_connector_metadata
    assert isinstance(meta, OffloadMetadata) and [t.req_id for t in meta.bulk_loads] == ["a"]
    assert len(meta.bulk_loads[0].chunks) == 4
    so = await step(core, outputs)
    assert so.scheduled_new_reqs[0].req_id == "a" and so.scheduled_new_reqs[0].num_computed_tokens == 64
    assert so.num_scheduled_tokens == {"b": 1, "a": 6}
    await run_until_idle(core, outputs)
    assert outputs["a"] == outputs["seed"] == oracle.greedy(p, N)
    assert outputs["b"] == oracle.greedy(q, N)
    stats = core.stats().extra
    assert stats["connector.async_loads"] == 1 and stats["connector.cpu.hit_tokens"] == 64


async def test_sync_mode_promotes_then_loads_within_the_step(oracle, make_core, tmp_path):
    core = await make_core(offload_config(load_mode="sync", tiers=(disk_tier(tmp_path / "disk"),)))
    p = prompt(22, 70)
    outputs: dict[str, list[int]] = {}
    add(core, "seed", p)
    await run_until_idle(core, outputs)
    await core.kv_connector.flush()
    assert core.reset_prefix_cache()
    core.kv_connector.store.l1.clear()
    add(core, "a", p)
    so = await step(core, outputs)
    assert so.num_scheduled_tokens == {} and not core.kv.has_request("a")  # promoting: no blocks held
    for _ in range(100):
        await asyncio.sleep(0.005)
        so = await step(core, outputs)
        if so.num_scheduled_tokens:
            break
    assert so.num_scheduled_tokens == {"a": 6}
    assert len(so.kv_connector_metadata.layer_loads[0].chunks) == 4
    await run_until_idle(core, outputs)
    assert outputs["a"] == oracle.greedy(p, N)
    stats = core.stats().extra
    assert stats["connector.sync_loads"] == 1 and stats["connector.async_loads"] == 0
    assert stats["connector.disk.hit_tokens"] == 64


async def test_a_preempted_request_is_offloaded_and_resumes_by_loading(oracle, make_engine, stepping):
    # Both 24-token prompts are admitted (12 of 16 blocks); growing by 16 tokens each, they cannot both fit.
    # Overlapped, the victim's save (of KV the step in flight is writing) rides on the step after it.
    engine = await make_engine(offload_config(), num_blocks=17, **stepping)
    prompts = [prompt(30 + i, 24) for i in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    async def one(p):
        return [t async for out in engine.generate(p, params) for t in out.new_token_ids]

    got = await asyncio.gather(*(one(p) for p in prompts))
    assert got == [oracle.greedy(p, 16) for p in prompts]
    stats = await engine.stats()
    assert stats.num_preemptions > 0
    assert stats.extra["connector.cpu.hit_tokens"] > 0
    assert_stepped(engine, stepping)


async def test_an_arriving_request_has_its_disk_chunks_promoted_before_it_is_scheduled(oracle, make_core, tmp_path):
    core = await make_core(offload_config(tiers=(disk_tier(tmp_path / "disk"),)))
    p = prompt(23, 70)
    outputs: dict[str, list[int]] = {}
    await seed_lower_tiers(core, p, outputs)
    add(core, "a", p)  # the arrival starts the promotion...
    for _ in range(100):
        await asyncio.sleep(0.005)  # ...while (in a real engine) other requests' step runs
        if not core.kv_connector.scheduler.has_pending_work():
            break
    so = await step(core, outputs)
    assert so.num_scheduled_tokens == {"a": 6}  # scheduled at its first step, chunks in hand
    assert len(so.kv_connector_metadata.layer_loads[0].chunks) == 4
    await run_until_idle(core, outputs)
    assert outputs["a"] == oracle.greedy(p, N)


async def test_without_prefetch_the_promotion_costs_a_step(oracle, make_core, tmp_path):
    core = await make_core(offload_config(max_prefetch=0, tiers=(disk_tier(tmp_path / "disk"),)))
    p = prompt(24, 70)
    outputs: dict[str, list[int]] = {}
    await seed_lower_tiers(core, p, outputs)
    add(core, "a", p)
    await asyncio.sleep(0.05)
    assert (await step(core, outputs)).num_scheduled_tokens == {}
    await run_until_idle(core, outputs)
    assert outputs["a"] == oracle.greedy(p, N)
    assert core.stats().extra["connector.disk.hit_tokens"] == 64
