"""Per-tier hit rates come from one place, the connector's books, and say
what the tiers delivered: a CPU-tier hit served on the fast path (no fetch)
counts for the CPU tier, a disk hit for the disk tier, and /metrics and the
bench report show exactly the connector's hit-token gauges."""

from __future__ import annotations

from conn_helpers import N, add, disk_tier, offload_config, prompt, run_until_idle, seed_lower_tiers

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
