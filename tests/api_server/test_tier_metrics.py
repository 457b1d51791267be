"""Per-tier hits on /metrics for every tier name a store can have: its
configured name, or its type when unnamed (``redis-cluster``, with a dash)
or a dotted class path. The page says each tier's hits and reads back."""

from __future__ import annotations

from kvstrata.api_server.metrics import parse_metrics, render_metrics, stats_from_metrics, tier_hit_rates
from kvstrata.types import EngineStats


def test_every_tier_name_gets_its_hits_series_and_reads_back():
    stats = EngineStats(prefix_cache_queries=100, prefix_cache_hits=10, extra={
        "connector.query_tokens": 90.0,
        "connector.cpu.hit_tokens": 30.0,
        "connector.redis-cluster.hit_tokens": 18.0,
        "connector.my_pkg.tiers.Remote.hit_tokens": 9.0,
    })
    assert tier_hit_rates(stats)["redis-cluster"] == {"hits": 18.0, "queries": 90.0, "hit_rate": 0.2}
    page = {(n, labels.get("tier")): v for n, labels, v in parse_metrics(render_metrics(stats, None, "m"))}
    assert page[("kvstrata_prefix_cache_hits_total", "redis-cluster")] == 18.0
    assert page[("kvstrata_prefix_cache_hit_rate", "redis-cluster")] == 0.2
    assert page[("kvstrata_prefix_cache_hits_total", "my_pkg.tiers.Remote")] == 9.0
    assert page[("kvstrata_prefix_cache_queries_total", "redis-cluster")] == 90.0
    assert tier_hit_rates(stats_from_metrics(render_metrics(stats, None, "m"))) == tier_hit_rates(stats)
