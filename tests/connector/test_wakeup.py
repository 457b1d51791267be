"""The connector wakes the engine (``KVConnector.set_wakeup``) whenever
something it should step for completes: a lookup answered, a promotion or an
asynchronous load landed, a store write (a save reaching a lower tier)
finished. Every connector has ``set_wakeup``; the default is no callback."""

from __future__ import annotations

import asyncio

from conn_helpers import (
    N,
    add,
    disk_tier,
    fs_tier,
    offload_config,
    prompt,
    run_until_idle,
    seed_lower_tiers,
    step,
)

from kvstrata.connector import KVConnectorFactory, KVTransferConfig, NoOpConnector, Wakeup


class Wakes:
    """The engine's side: counts wake-ups, and notes the connector's pending
    work at each (a completion has already left it)."""

    def __init__(self, core) -> None:
        self.sched = core.kv_connector.scheduler
        self.pending: list[bool] = []

    def __call__(self) -> None:
        self.pending.append(self.sched.has_pending_work())

    async def wait(self, n: int = 1) -> None:
        for _ in range(400):
            if len(self.pending) >= n:
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"{len(self.pending)} wake-ups, expected {n}")


async def test_a_store_write_wakes_the_engine(oracle, make_core, tmp_path):
    core = await make_core(offload_config(tiers=(disk_tier(tmp_path / "disk"),)))
    wakes = Wakes(core)
    core.kv_connector.set_wakeup(wakes)
    outputs: dict[str, list[int]] = {}
    p = prompt(60, 40)  # two full chunks, saved as they fill, written through to the disk
    add(core, "a", p)
    await run_until_idle(core, outputs)
    await core.kv_connector.flush()
    assert len(wakes.pending) == 2 and core.kv_connector.store.stats().tier("disk").puts == 2
    assert outputs["a"] == oracle.greedy(p, N)


async def test_a_lookup_answered_and_an_async_load_landed_wake_the_engine(oracle, make_core, tmp_path):
    core = await make_core(offload_config(tiers=(fs_tier(tmp_path / "fs"),)))
    outputs: dict[str, list[int]] = {}
    p = prompt(61, 40)
    await seed_lower_tiers(core, p, outputs)
    wakes = Wakes(core)
    core.kv_connector.set_wakeup(wakes)
    add(core, "a", p)  # the fs tier cannot tell without asking: the arrival starts a lookup
    await wakes.wait(1)
    assert wakes.pending == [False]  # the lookup answered
    so = await step(core, outputs)  # a remote tier: blocks allocated, the fetch starts
    assert so.num_scheduled_tokens == {} and core.kv.has_request("a")
    await wakes.wait(2)  # the fetch landed
    await run_until_idle(core, outputs)
    assert outputs["a"] == oracle.greedy(p, N)
    assert core.stats().extra["connector.async_loads"] == 1


async def test_a_promotion_landed_wakes_the_engine(oracle, make_core, tmp_path):
    core = await make_core(offload_config(load_mode="sync", max_prefetch=0,
                                          tiers=(disk_tier(tmp_path / "disk"),)))
    outputs: dict[str, list[int]] = {}
    p = prompt(62, 40)
    await seed_lower_tiers(core, p, outputs)
    wakes = Wakes(core)
    core.kv_connector.set_wakeup(wakes)
    add(core, "a", p)
    assert (await step(core, outputs)).num_scheduled_tokens == {}  # promoting from disk: no blocks held
    await wakes.wait(1)
    assert wakes.pending == [False]
    so = await step(core, outputs)
    assert so.num_scheduled_tokens == {"a": 8}  # 32 tokens loaded within the step
    await run_until_idle(core, outputs)
    assert outputs["a"] == oracle.greedy(p, N)


async def test_nothing_wakes_without_a_callback_and_a_raising_callback_is_contained(make_core, tmp_path):
    core = await make_core(offload_config(tiers=(disk_tier(tmp_path / "disk"),)))
    outputs: dict[str, list[int]] = {}
    add(core, "a", prompt(63, 20))
    await run_until_idle(core, outputs)  # no callback set: writes complete silently
    await core.kv_connector.flush()

    def broken() -> None:
        raise RuntimeError("the loop is closed")

    core.kv_connector.set_wakeup(broken)
    add(core, "b", prompt(64, 20))
    await run_until_idle(core, outputs)
    await core.kv_connector.flush()
    assert core.kv_connector.store.stats().tier("disk").puts == 2


async def test_every_connector_takes_a_wakeup(tmp_path):
    calls: list[int] = []
    wake = Wakeup()
    wake()  # none set: nothing happens
    wake.set(lambda: calls.append(1))
    wake(object())  # usable as a done callback
    assert calls == [1]
    factory = KVConnectorFactory()
    noop = await factory.open(KVTransferConfig(connector="noop"))
    assert isinstance(noop, NoOpConnector)
    noop.set_wakeup(lambda: calls.append(2))
    multi = await factory.open(KVTransferConfig(connector="multi", options={"connectors": [
        {"connector": "noop"}, {"connector": "offload", "options": offload_config().options}]}))
    try:
        multi.set_wakeup(wake)
        assert multi.children[1].wakeup is not None
        multi.children[1].wakeup()
        assert calls == [1, 1]
    finally:
        await multi.aclose()
