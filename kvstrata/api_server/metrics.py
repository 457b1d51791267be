"""Prometheus text exposition for ``/metrics`` (format 0.0.4), without a
client library: engine counters from ``EngineStats`` and latency histograms
measured by the server.

Per-tier hit rates: the device tier comes from the prefix cache counters; a
lower tier ``<tier>`` comes from ``EngineStats.extra`` keys
``store.<tier>.hit_tokens`` plus ``store.<tier>.query_tokens`` or
``store.<tier>.miss_tokens`` (queries = hits + misses), the convention
``tier_hit_rates`` reads; other ``extra`` keys are exported as gauges.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Sequence

from kvstrata.types import EngineStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)

_NAME_BAD = re.compile(r"[^a-zA-Z0-9_]")
_TIER_KEY = re.compile(r"^store\.([A-Za-z0-9_]+)\.(hit_tokens|query_tokens|miss_tokens)$")


class Histogram:
    """Cumulative-bucket histogram. Owns: its bucket counts, sum and count."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        acc = 0
        for bound, n in zip(self.bounds, self.counts):
            acc += n
            lines.append(f'{name}_bucket{{le="{_fmt(bound)}"}} {acc}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {_fmt(self.sum)}")
        lines.append(f"{name}_count {self.count}")
        return lines


class ServerMetrics:
    """What the HTTP server measures itself. Owns: latency histograms and
    request counters (the engine's own counters come from EngineStats)."""

    __slots__ = ("ttft", "itl", "e2e", "requests", "prompt_tokens", "generation_tokens")

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.requests: dict[str, int] = {}  # finish_reason / "rejected" -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def count_request(self, outcome: str) -> None:
        self.requests[outcome] = self.requests.get(outcome, 0) + 1


def tier_hit_rates(stats: EngineStats) -> dict[str, dict[str, float]]:
    """``{tier: {"hits": h, "queries": q, "hit_rate": h/q}}`` for every tier the
    stats describe; "device" always (the paged prefix cache)."""
    tiers: dict[str, dict[str, float]] = {
        "device": {"hits": float(stats.prefix_cache_hits), "queries": float(stats.prefix_cache_queries)}
    }
    raw: dict[str, dict[str, float]] = {}
    for key, value in stats.extra.items():
        m = _TIER_KEY.match(key)
        if m:
            raw.setdefault(m.group(1), {})[m.group(2)] = float(value)
    for tier, r in raw.items():
        hits = r.get("hit_tokens", 0.0)
        queries = r["query_tokens"] if "query_tokens" in r else hits + r.get("miss_tokens", 0.0)
        tiers[tier] = {"hits": hits, "queries": queries}
    for t in tiers.values():
        t["hit_rate"] = t["hits"] / t["queries"] if t["queries"] > 0 else 0.0
    return tiers


def render_metrics(stats: EngineStats, server: ServerMetrics | None, model_name: str) -> str:
    """The full /metrics page."""
    label = f'model_name="{_escape(model_name)}"'
    lines: list[str] = []
    gauge = _emitter(lines, "gauge", label)
    counter = _emitter(lines, "counter", label)
    gauge("kvstrata_num_requests_running", "Requests in the running batch.", stats.num_running)
    gauge("kvstrata_num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
    gauge("kvstrata_kv_cache_usage_ratio", "Fraction of device KV blocks in use.", stats.kv_usage)
    counter("kvstrata_num_preemptions_total", "Requests preempted for lack of KV blocks.", stats.num_preemptions)
    counter("kvstrata_requests_finished_total", "Requests finished by the engine.", stats.num_finished)
    counter("kvstrata_prompt_tokens_total", "Prompt tokens processed.", stats.num_prompt_tokens)
    counter("kvstrata_generation_tokens_total", "Tokens generated.", stats.num_generated_tokens)
    tiers = tier_hit_rates(stats)
    _per_tier(lines, "kvstrata_prefix_cache_queries_total", "counter", "Prompt tokens looked up, per tier.", label, tiers, "queries")
    _per_tier(lines, "kvstrata_prefix_cache_hits_total", "counter", "Prompt tokens found, per tier.", label, tiers, "hits")
    _per_tier(lines, "kvstrata_prefix_cache_hit_rate", "gauge", "Hits over queries since start, per tier.", label, tiers, "hit_rate")
    for key in sorted(stats.extra):
        if not _TIER_KEY.match(key):
            gauge("kvstrata_" + _NAME_BAD.sub("_", key), f"Engine counter {key}.", stats.extra[key])
    if server is not None:
        _render_server(lines, server, label)
    return "\n".join(lines) + "\n"


def _render_server(lines: list[str], server: ServerMetrics, label: str) -> None:
    lines += server.ttft.render("kvstrata_time_to_first_token_seconds", "Time to first token, measured by the server.")
    lines += server.itl.render("kvstrata_inter_token_latency_seconds", "Time between streamed outputs, measured by the server.")
    lines += server.e2e.render("kvstrata_e2e_request_latency_seconds", "Request latency from arrival to finish.")
    lines += ["# HELP kvstrata_http_requests_total HTTP generation requests by outcome.",
              "# TYPE kvstrata_http_requests_total counter"]
    for outcome in sorted(server.requests):
        lines.append(f'kvstrata_http_requests_total{{{label},outcome="{_escape(outcome)}"}} {server.requests[outcome]}')


def _emitter(lines: list[str], kind: str, label: str):
    def emit(name: str, help_text: str, value: float) -> None:
        lines.extend((f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{{{label}}} {_fmt(value)}"))
    return emit


def _per_tier(lines: list[str], name: str, kind: str, help_text: str, label: str,
              tiers: dict[str, dict[str, float]], field: str) -> None:
    lines.extend((f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"))
    for tier, vals in tiers.items():
        lines.append(f'{name}{{{label},tier="{_escape(tier)}"}} {_fmt(vals[field])}')


def parse_metrics(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    """Parse our own exposition back (the load tester reads /metrics)."""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))
        yield name, labels, float(value)


def _fmt(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
