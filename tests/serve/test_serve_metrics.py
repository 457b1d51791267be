"""Prometheus text: histogram buckets, per-tier hit rates, parse round trip."""

from kvstrata.types import EngineStats
from kvstrata.api_server.metrics import Histogram, ServerMetrics, parse_metrics, render_metrics, tier_hit_rates


def test_histogram_buckets_are_cumulative():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v)
    lines = h.render("x", "help")
    assert 'x_bucket{le="0.1"} 2' in lines
    assert 'x_bucket{le="1.0"} 3' in lines
    assert 'x_bucket{le="+Inf"} 4' in lines
    assert "x_count 4" in lines and "x_sum 2.65" in lines


def test_tier_hit_rates_from_prefix_counters_and_extra():
    stats = EngineStats(prefix_cache_queries=200, prefix_cache_hits=50,
                        extra={"store.cpu.hit_tokens": 30.0, "store.cpu.query_tokens": 150.0,
                               "store.disk.hit_tokens": 0.0, "kv.evictions": 4.0,
                               "store.redis.hit_tokens": 10.0, "store.redis.miss_tokens": 30.0})
    tiers = tier_hit_rates(stats)
    assert tiers["device"] == {"hits": 50.0, "queries": 200.0, "hit_rate": 0.25}
    assert tiers["cpu"] == {"hits": 30.0, "queries": 150.0, "hit_rate": 0.2}
    assert tiers["disk"]["hit_rate"] == 0.0
    assert tiers["redis"] == {"hits": 10.0, "queries": 40.0, "hit_rate": 0.25}
    assert set(tiers) == {"device", "cpu", "disk", "redis"}


def test_render_and_parse_round_trip():
    stats = EngineStats(num_running=3, num_waiting=1, kv_usage=0.5, prefix_cache_queries=10,
                        prefix_cache_hits=4, num_preemptions=2, extra={"store.cpu.hit_tokens": 1.0,
                                                                        "store.cpu.query_tokens": 6.0,
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
