"""Prometheus text: histogram buckets, per-tier hit rates, block residency,
parse round trip (every EngineStats field), and the bench report's deltas."""

import msgspec

from kvstrata.types import BlockResidencyStats, EngineStats, HistogramSnapshot
from kvstrata.api_server.metrics import (
    Histogram,
    ServerMetrics,
    parse_metrics,
    render_metrics,
    stats_from_metrics,
    tier_hit_rates,
)
from kvstrata.bench.report import engine_deltas


def test_histogram_buckets_are_cumulative():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v)
    lines = h.render("x", "help")
    assert 'x_bucket{le="0.1"} 2' in lines
    assert 'x_bucket{le="1.0"} 3' in lines
    assert 'x_bucket{le="+Inf"} 4' in lines
    assert "x_count 4" in lines and "x_sum 2.65" in lines


def test_tier_hit_rates_from_prefix_counters_and_the_connector_books():
    # store.* counters (the fetch path alone) are raw gauges, not hit rates
    stats = EngineStats(prefix_cache_queries=200, prefix_cache_hits=50,
                        extra={"connector.cpu.hit_tokens": 30.0, "connector.query_tokens": 150.0,
                               "connector.disk.hit_tokens": 0.0, "kv.evictions": 4.0,
                               "connector.redis.hit_tokens": 15.0, "store.cpu.hit_tokens": 2.0})
    tiers = tier_hit_rates(stats)
    assert tiers["device"] == {"hits": 50.0, "queries": 200.0, "hit_rate": 0.25}
    assert tiers["cpu"] == {"hits": 30.0, "queries": 150.0, "hit_rate": 0.2}
    assert tiers["disk"]["hit_rate"] == 0.0
    assert tiers["redis"] == {"hits": 15.0, "queries": 150.0, "hit_rate": 0.1}
    assert set(tiers) == {"device", "cpu", "disk", "redis"}


def test_render_and_parse_round_trip():
    stats = EngineStats(num_running=3, num_waiting=1, kv_usage=0.5, prefix_cache_queries=10,
                        prefix_cache_hits=4, num_preemptions=2, extra={"connector.cpu.hit_tokens": 1.0,
                                                                        "connector.query_tokens": 6.0,
                                                                        "kv.evictions": 7.0})
    server = ServerMetrics()
    server.ttft.observe(0.02)
    server.itl.observe(0.003)
    server.count_request("length")
    text = render_metrics(stats, server, 'm"1')
    got = {(n, tuple(sorted(l.items()))): v for n, l, v in parse_metrics(text)}
    lbl = ("model_name", 'm\\"1')
    assert got[("kvstrata_num_requests_running", (lbl,))] == 3
    assert got[("kvstrata_num_preemptions_total", (lbl,))] == 2
    assert got[("kvstrata_prefix_cache_hit_rate", (lbl, ("tier", "device")))] == 0.4
    assert got[("kvstrata_prefix_cache_queries_total", (lbl, ("tier", "cpu")))] == 6
    assert got[("kvstrata_kv_evictions", (lbl,))] == 7
    assert got[("kvstrata_time_to_first_token_seconds_count", ())] == 1
    assert got[("kvstrata_http_requests_total", (lbl, ("outcome", "length")))] == 1
    assert text.endswith("\n")
    assert "# TYPE kvstrata_inter_token_latency_seconds histogram" in text


def _residency() -> BlockResidencyStats:
    bounds = (0.1, 1.0)
    return BlockResidencyStats(
        sample_rate=0.01, num_samples=3, num_reuses=2,
        lifetime_s=HistogramSnapshot(bounds=bounds, counts=(0, 1, 2), sum=7.5, count=3),
        idle_before_eviction_s=HistogramSnapshot(bounds=bounds, counts=(1, 2, 0), sum=1.25, count=3),
        reuse_gap_s=HistogramSnapshot(bounds=bounds, counts=(2, 0, 0), sum=0.125, count=2),
    )


def test_block_residency_is_exported_as_histograms():
    text = render_metrics(EngineStats(block_residency=_residency()), None, "m")
    lines = text.splitlines()
    assert "# TYPE kvstrata_kv_block_lifetime_seconds histogram" in lines
    assert 'kvstrata_kv_block_lifetime_seconds_bucket{model_name="m",le="0.1"} 0' in lines
    assert 'kvstrata_kv_block_lifetime_seconds_bucket{model_name="m",le="1.0"} 1' in lines
    assert 'kvstrata_kv_block_lifetime_seconds_bucket{model_name="m",le="+Inf"} 3' in lines
    assert 'kvstrata_kv_block_lifetime_seconds_sum{model_name="m"} 7.5' in lines
    assert 'kvstrata_kv_block_reuse_gap_seconds_count{model_name="m"} 2' in lines
    assert 'kvstrata_kv_block_residency_samples_total{model_name="m"} 3' in lines
    assert 'kvstrata_kv_block_residency_reuses_total{model_name="m"} 2' in lines
    assert "kvstrata_kv_block" not in render_metrics(EngineStats(), None, "m")  # sampling off


def test_every_engine_stat_reads_back_from_the_page():
    stats = EngineStats(num_running=3, num_waiting=1, kv_usage=0.5, prefix_cache_queries=10, prefix_cache_hits=4,
                        num_preemptions=2, num_finished=5, num_generated_tokens=40, num_prompt_tokens=90,
                        block_residency=_residency(),
                        extra={"connector.cpu.hit_tokens": 1.0, "connector.query_tokens": 6.0,
                               "kv.prefix_cache.preempted_hits": 7.0, "engine.failed_steps": 1.0})
    server = ServerMetrics()
    server.ttft.observe(0.02)
    back = stats_from_metrics(render_metrics(stats, server, "m"))
    assert back == msgspec.structs.replace(stats, extra={
        "connector.cpu.hit_tokens": 1.0, "connector.query_tokens": 6.0,
        "connector_cpu_hit_tokens": 1.0, "connector_query_tokens": 6.0,  # the connector's own gauges too
        "kv_prefix_cache_preempted_hits": 7.0, "engine_failed_steps": 1.0})
    assert tier_hit_rates(back) == tier_hit_rates(stats)


def test_bench_report_carries_every_engine_stat_as_run_deltas():
    before = EngineStats(prefix_cache_queries=10, prefix_cache_hits=2, num_preemptions=1, num_finished=1,
                         num_prompt_tokens=10, num_generated_tokens=3,
                         block_residency=msgspec.structs.replace(
                             _residency(), num_samples=1, num_reuses=0,
                             lifetime_s=HistogramSnapshot(bounds=(0.1, 1.0), counts=(0, 1, 0), sum=0.5, count=1)),
                         extra={"engine.failed_steps": 0.0})
    after = EngineStats(num_running=2, kv_usage=0.25, prefix_cache_queries=110, prefix_cache_hits=52,
                        num_preemptions=4, num_finished=6, num_prompt_tokens=110, num_generated_tokens=43,
                        block_residency=_residency(), extra={"engine.failed_steps": 1.0})
    d = engine_deltas(before, after)
    assert d["prefix_cache"]["device"] == {"hit_tokens": 50, "query_tokens": 100, "hit_rate": 0.5}
    assert d["preemptions"] == 3 and d["kv_usage_at_end"] == 0.25
    assert d["engine"] == {"finished": 5, "prompt_tokens": 100, "generated_tokens": 40, "running_at_end": 2,
                           "waiting_at_end": 0, "extra_at_end": {"engine_failed_steps": 1.0}}
    res = d["kv_block_residency"]
    assert (res["sample_rate"], res["samples"], res["reuses"]) == (0.01, 2, 2)
    # lifetime: after (0, 1, 2) sum 7.5 minus before (0, 1, 0) sum 0.5: two blocks above 1 s, 3.5 s each
    assert res["lifetime_s"] == {"count": 2, "mean": 3.5, "p50_le": "+Inf", "p90_le": "+Inf"}
    assert res["idle_before_eviction_s"] == {"count": 0, "mean": None, "p50_le": None, "p90_le": None}
    alone = engine_deltas(None, after)["kv_block_residency"]["idle_before_eviction_s"]
    assert alone == {"count": 3, "mean": 0.4167, "p50_le": 1.0, "p90_le": 1.0}  # (1, 2, 0) over (0.1, 1.0)
    assert engine_deltas(None, EngineStats())["kv_block_residency"] is None
