"""Per-tier hit rates come from one place, the connector's books, and say
what the tiers delivered: a CPU-tier hit served on the fast path (no fetch)
counts for the CPU tier, a disk hit for the disk tier, and /metrics and the
bench report show exactly the connector's hit-token gauges."""

from __future__ import annotations

from conn_helpers import CHUNK, N, add, disk_tier, offload_config, prompt, run_until_idle, seed_lower_tiers

from kvstrata.api_server.metrics import parse_metrics, render_metrics, tier_hit_rates
from kvstrata.bench.report import engine_deltas


async def test_cpu_fast_path_and_disk_hits_are_booked_per_tier(oracle, make_core, tmp_path):
    core = await make_core(offload_config(tiers=(disk_tier(tmp_path / "disk"),)))
    outputs: dict[str, list[int]] = {}
    p, q = prompt(900, 70), prompt(901, 70)
    # q's chunks only on disk
    await seed_lower_tiers(core, q, outputs)
    # p computed once: its chunks stay in CPU memory (L1) ...
    add(core, "p0", p)
    await run_until_idle(core, outputs)
    await core.kv_connector.flush()
    assert core.reset_prefix_cache()  # ... and leave the device cache
    before = core.stats()
    add(core, "p1", p)  # the CPU tier serves it from L1: no fetch
    add(core, "q1", q)  # the disk tier serves it
    await run_until_idle(core, outputs)
    assert outputs["p1"] == oracle.greedy(p, N) and outputs["q1"] == oracle.greedy(q, N)
    stats = core.stats()
    extra = stats.extra
    cpu, disk = extra["connector.cpu.hit_tokens"], extra["connector.disk.hit_tokens"]
    assert cpu == 64 and disk == 64  # four 16-token chunks each (the 70th token is computed)
    tiers = tier_hit_rates(stats)
    assert tiers["cpu"]["hits"] == cpu and tiers["disk"]["hits"] == disk
    assert tiers["cpu"]["queries"] == extra["connector.query_tokens"] > 0
    # the store's fetch-path counter missed the fast path: it is not the rate's source
    assert extra.get("store.cpu.hit_tokens", 0.0) < cpu
    page = {(n, l.get("tier")): v for n, l, v in parse_metrics(render_metrics(stats, None, "m"))}
    assert page[("kvstrata_prefix_cache_hits_total", "cpu")] == cpu
    assert page[("kvstrata_prefix_cache_hits_total", "disk")] == disk
    assert page[("kvstrata_connector_cpu_hit_tokens", None)] == cpu  # the gauge and the rate agree
    assert page[("kvstrata_prefix_cache_hit_rate", "cpu")] == cpu / extra["connector.query_tokens"]
    report = engine_deltas(before, stats)["prefix_cache"]
    assert report["cpu"]["hit_tokens"] == cpu - before.extra["connector.cpu.hit_tokens"] == 64
    assert report["disk"]["hit_tokens"] == 64
    assert report["cpu"]["query_tokens"] == extra["connector.query_tokens"] - before.extra["connector.query_tokens"]
    assert extra["kv.external_hit_tokens"] == cpu + disk  # the same books, summed


async def test_a_tier_hit_is_counted_once_as_what_the_tier_delivered(oracle, make_engine, tmp_path):
    """``kv.external_hit_tokens`` is the connector's per-tier books summed,
    so it counts each tier hit once, as what was loaded: an async load of
    four disk chunks whose second is corrupt delivers one chunk (the rest is
    recomputed), and one chunk is what both counts say (the scheduler's own
    count, gone, booked the four chunks it was promised at admission)."""
    from kvstrata.enginecore import SamplingParams
    from kvstrata.enginecore.request import Request

    engine = await make_engine(offload_config(load_mode="async", tiers=(disk_tier(tmp_path / "disk"),)))
    params = SamplingParams(temperature=0.0, max_tokens=N)
    p = prompt(902, 70)

    async def gen() -> list[int]:
        return [t async for out in engine.generate(p, params) for t in out.new_token_ids]

    assert await gen() == oracle.greedy(p, N)
    await engine.flush_kv()
    assert await engine.reset_prefix_cache()
    connector = engine.core.kv_connector
    connector.store.l1.clear()
    hasher = engine.core.block_hasher
    hashes = Request("probe", p, SamplingParams(), block_hasher=hasher, hash_block_size=hasher.block_size).block_hashes
    chunk1 = connector.scheduler.keyer.keys(hashes)[1].name
    victim = next(f for f in (tmp_path / "disk").rglob("*") if f.is_file() and chunk1 in f.name)
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF  # the checksum no longer matches
    victim.write_bytes(bytes(data))
    assert await gen() == oracle.greedy(p, N)
    extra = (await engine.stats()).extra
    assert extra["connector.async_loads"] == 1 and extra["connector.load_failed_tokens"] == 3 * CHUNK
    assert extra["connector.disk.hit_tokens"] == CHUNK
    assert extra["kv.external_hit_tokens"] == CHUNK == sum(
        v for k, v in extra.items() if k.startswith("connector.") and k.endswith(".hit_tokens"))
