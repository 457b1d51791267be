"""Selective admission of chunks into the tiers (``save_admission``), through
a real engine core on the tiny Llama: one-off prompts are not saved, a
recurring prefix is saved and later hit, a conversation's turns hit their
history, tokens equal the oracle's (so those of "all"), and an L1 no larger
than the device pool keeps serving a hot prefix under one-off prompts.

The device prefix cache is reset between requests where a test needs the
tiers to answer (a device hit needs no tier, and its chunks are not saved
again by the request that hits them)."""

from __future__ import annotations

import pytest
from conn_helpers import N, add, disk_tier, offload_config, prompt, run_until_idle

SELECTIVE = ["seen", "tinylfu"]


async def core_with(make_core, mode: str, *, num_blocks: int = 64, sched: dict | None = None, **kw):
    core = await make_core(offload_config(save_admission=mode, **kw), num_blocks=num_blocks, **(sched or {}))
    return core


async def serve(core, rid: str, p: list[int], outputs: dict, *, forget_device: bool = True) -> None:
    add(core, rid, p)
    await run_until_idle(core, outputs)
    await core.kv_connector.flush()
    if forget_device:
        assert core.reset_prefix_cache()


def cpu_hits(core) -> float:
    return core.stats().extra.get("connector.cpu.hit_tokens", 0.0)


def admission(core) -> dict[str, float]:
    return core.kv_connector.scheduler.saves.stats()


@pytest.mark.parametrize("mode", SELECTIVE)
async def test_one_off_prompts_are_not_saved(oracle, make_core, mode, tmp_path):
    """Neither mode writes one-off chunks to disk; "seen" keeps them out of
    L1 too, "tinylfu" copies them into L1 while it has room (it evicts nothing)."""
    core = await core_with(make_core, mode, tiers=(disk_tier(tmp_path / "disk"),))
    outputs: dict[str, list[int]] = {}
    for i in range(3):
        p = prompt(1000 + i, 70)  # 4 full chunks each, never asked again
        await serve(core, f"r{i}", p, outputs)
        assert outputs[f"r{i}"] == oracle.greedy(p, N)
    await core.kv_connector.store.drain()
    tiers = core.kv_connector.store.stats().tiers
    assert tiers[1].num_objects == 0  # disk: nothing
    if mode == "seen":
        assert admission(core) == {"connector.save_admission_admitted": 0.0, "connector.save_admission_rejected": 12.0}
        assert tiers[0].num_objects == 0
        assert core.stats().extra.get("connector.saved_chunks", 0.0) == 0
    else:
        assert tiers[0].num_objects == 12


async def test_a_chunk_read_from_l1_is_written_down_to_disk(oracle, make_core, tmp_path):
    """tinylfu: a chunk kept in L1 only reaches the disk once it is read."""
    core = await core_with(make_core, "tinylfu", tiers=(disk_tier(tmp_path / "disk"),))
    outputs: dict[str, list[int]] = {}
    p = prompt(1100, 70)
    await serve(core, "a", p, outputs)
    store = core.kv_connector.store
    await store.drain()
    assert store.stats().tiers[1].num_objects == 0
    await serve(core, "b", p, outputs)  # hits the 4 chunks in L1: they proved useful
    await store.drain()
    assert store.stats().tiers[1].num_objects == 4
    assert outputs["a"] == outputs["b"] == oracle.greedy(p, N)


async def test_all_saves_every_chunk(oracle, make_core):
    core = await core_with(make_core, "all")
    outputs: dict[str, list[int]] = {}
    await serve(core, "r0", prompt(1000, 70), outputs)
    assert admission(core) == {"connector.save_admission_admitted": 4.0, "connector.save_admission_rejected": 0.0}
    assert core.kv_connector.store.stats().tiers[0].num_objects == 4


@pytest.mark.parametrize("mode", SELECTIVE)
async def test_a_recurring_prefix_is_saved_and_hit(oracle, make_core, mode):
    core = await core_with(make_core, mode)
    outputs: dict[str, list[int]] = {}
    head = prompt(2000, 32)  # 2 chunks, under half of each prompt: not a continuation
    ps = [head + prompt(2001 + i, 60) for i in range(3)]
    await serve(core, "a", ps[0], outputs)
    if mode == "seen":  # first sighting: nothing saved
        assert core.kv_connector.store.stats().tiers[0].num_objects == 0
        await serve(core, "b", ps[1], outputs)  # the head recurs: its 2 chunks saved, b's own 3 are not
        assert core.kv_connector.store.stats().tiers[0].num_objects == 2
        # a: 5 prompt chunks + 1 of prompt and reply (99 tokens computed); b: 3 + 1
        assert admission(core)["connector.save_admission_rejected"] == 6 + 4
    else:  # L1 has room: a's 6 chunks are copied in; b hits the head there
        assert core.kv_connector.store.stats().tiers[0].num_objects == 6
        before = cpu_hits(core)
        await serve(core, "b", ps[1], outputs)
        assert cpu_hits(core) - before == 32
    before = cpu_hits(core)
    await serve(core, "c", ps[2], outputs)
    assert cpu_hits(core) - before == 32
    for rid, p in zip("abc", ps):
        assert outputs[rid] == oracle.greedy(p, N)


@pytest.mark.parametrize("mode", ["all", *SELECTIVE])
async def test_a_conversation_hits_its_history(oracle, make_core, mode):
    core = await core_with(make_core, mode)
    outputs: dict[str, list[int]] = {}
    history: list[int] = []
    hits = []
    for t in range(4):
        p = history + prompt(3000 + t, 40 if t == 0 else 24)
        before = cpu_hits(core)
        await serve(core, f"t{t}", p, outputs)
        hits.append(cpu_hits(core) - before)
        assert outputs[f"t{t}"] == oracle.greedy(p, N)  # the oracle's tokens: the same as under "all"
        history = p + outputs[f"t{t}"]
    if mode in ("all", "tinylfu"):  # tinylfu: L1 has room, every turn is copied in
        assert hits == [0, 32, 64, 96]
    else:  # turn 1 looks like a one-off; turn 2 recurs and saves all of its own; from turn 3 on, hits
        assert hits[:2] == [0, 0] and hits[2] == 64 and hits[3] == 96


@pytest.mark.parametrize("mode", ["all", *SELECTIVE])
async def test_small_l1_keeps_serving_a_hot_prefix_under_one_off_prompts(oracle, make_core, mode):
    # device pool: 47 blocks of 4 = 188 tokens; L1: 6 chunks of 16 = 96 tokens (smaller)
    # chunked prefill (32 tokens a step): the hot chunks' loads are over when the one-offs' saves come
    core = await core_with(make_core, mode, cpu_chunks=6, num_blocks=48, sched={"max_num_batched_tokens": 32})
    outputs: dict[str, list[int]] = {}
    hot = prompt(4000, 32)
    n = 6
    for i in range(n):
        p = hot + prompt(4001 + i, 112)  # 9 full chunks: 2 hot, then 7 one-off (more than L1 holds)
        await serve(core, f"r{i}", p, outputs)
        assert outputs[f"r{i}"] == oracle.greedy(p, N)
    hits = cpu_hits(core)
    if mode == "all":
        assert hits == 0  # every request's one-off chunks push the hot ones out of L1
    else:  # seen: saved by the 2nd request; tinylfu: the 1st's own one-offs may push it
        # out (a tie goes to the newer chunk) until the 2nd makes it twice seen; then kept
        assert hits == 32 * (n - 2)
