"""Prometheus text exposition for ``/metrics`` (format 0.0.4), without a
client library: every field of ``EngineStats`` and latency histograms
measured by the server; ``stats_from_metrics`` reads an ``EngineStats``
back (the load tester, against a server).

Per-tier hit rates: the device tier comes from the prefix cache counters; a
lower tier ``<tier>`` comes from ``EngineStats.extra`` keys
``store.<tier>.hit_tokens`` plus ``store.<tier>.query_tokens`` or
``store.<tier>.miss_tokens`` (queries = hits + misses), the convention
``tier_hit_rates`` reads; other ``extra`` keys are exported as gauges named
``kvstrata_<key>`` (``metric_name``). Sampled KV block residency is three
histograms (lifetime, idle time before eviction, gaps between reuses) and
two counters.

A fleet (``FleetStats``): the unlabelled series are the fleet's totals
(counters summed, KV usage and known rates recomputed from the sums:
``fleet.stats``); ``kvstrata_replica_up{replica=...}`` says which replicas
serve, and every value that does not add up across replicas (flags,
ratios, estimates) is a series per replica, labelled ``replica``, and never
an unlabelled one (``kvstrata_replica_kv_cache_usage_ratio`` for each
replica's KV usage).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Sequence
from typing import Any

from kvstrata.fleet.stats import FleetStats, is_additive
from kvstrata.types import BlockResidencyStats, EngineStats, HistogramSnapshot

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)

_NAME_BAD = re.compile(r"[^a-zA-Z0-9_]")
# The connector's books, the one place per-tier hits are counted: every
# tier's hit_tokens over the tokens its lookups asked about (query_tokens).
# A tier's name is its configured name or its type ("redis-cluster", or a
# dotted class path): anything between the two fixed parts.
_TIER_HITS = re.compile(r"^connector\.(.+)\.hit_tokens$")
_QUERY_KEY = "connector.query_tokens"


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

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(bounds=self.bounds, counts=tuple(self.counts), sum=self.sum, count=self.count)

    def render(self, name: str, help_text: str) -> list[str]:
        return render_histogram(name, help_text, self.snapshot())


def render_histogram(name: str, help_text: str, h: HistogramSnapshot, label: str = "") -> list[str]:
    """A histogram's exposition: cumulative ``le`` buckets, sum and count."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    head = f"{label}," if label else ""
    tail = f"{{{label}}}" if label else ""
    acc = 0
    for bound, n in zip(h.bounds, h.counts):
        acc += n
        lines.append(f'{name}_bucket{{{head}le="{_fmt(bound)}"}} {acc}')
    lines.append(f'{name}_bucket{{{head}le="+Inf"}} {h.count}')
    lines.append(f"{name}_sum{tail} {_fmt(h.sum)}")
    lines.append(f"{name}_count{tail} {h.count}")
    return lines


def metric_name(extra_key: str) -> str:
    """The gauge an ``EngineStats.extra`` key is exported as."""
    return "kvstrata_" + _NAME_BAD.sub("_", extra_key)


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
    """``{tier: {"hits": h, "queries": q, "hit_rate": h/q}}`` for "device" (the
    paged prefix cache: its hits over its queries) and every store tier the
    KV connector books: the prompt tokens that tier served (however: the CPU
    fast path, a promotion, an async load) over the tokens the connector's
    lookups asked about past the device hit. The same numbers as the
    connector's ``connector.<tier>.hit_tokens`` gauges, by construction."""
    tiers: dict[str, dict[str, float]] = {
        "device": {"hits": float(stats.prefix_cache_hits), "queries": float(stats.prefix_cache_queries)}
    }
    queries = float(stats.extra.get(_QUERY_KEY, 0.0))
    for key, value in stats.extra.items():
        m = _TIER_HITS.match(key)
        if m:
            tiers[m.group(1)] = {"hits": float(value), "queries": queries}
    for t in tiers.values():
        t["hit_rate"] = t["hits"] / t["queries"] if t["queries"] > 0 else 0.0
    return tiers


def render_metrics(stats: EngineStats | None, server: ServerMetrics | None, model_name: str, *,
                   fleet: FleetStats | None = None) -> str:
    """The full /metrics page: the engine's stats (a fleet's totals; None
    when no replica answered), a fleet's per-replica series, the server's own."""
    label = f'model_name="{_escape(model_name)}"'
    lines: list[str] = []
    if stats is not None:
        _render_engine(lines, stats, label)
    if fleet is not None:
        _render_replicas(lines, fleet, label)
    if server is not None:
        _render_server(lines, server, label)
    return "\n".join(lines) + "\n"


def _render_engine(lines: list[str], stats: EngineStats, label: str) -> None:
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
    _per_tier(lines, "kvstrata_prefix_cache_queries_total", "counter",
              "Prompt tokens looked up, per tier (store tiers: past the device hit).", label, tiers, "queries")
    _per_tier(lines, "kvstrata_prefix_cache_hits_total", "counter",
              "Prompt tokens served, per tier (store tiers: the connector's hit_tokens).", label, tiers, "hits")
    _per_tier(lines, "kvstrata_prefix_cache_hit_rate", "gauge", "Hits over queries since start, per tier.", label, tiers, "hit_rate")
    for key in sorted(stats.extra):
        gauge(metric_name(key), f"Engine counter {key}.", stats.extra[key])
    if stats.block_residency is not None:
        _render_residency(lines, stats.block_residency, label)


def _render_replicas(lines: list[str], fleet: FleetStats, label: str) -> None:
    """Per replica: whether it serves, its KV usage, and each value of its
    ``extra`` that does not add up across replicas (``is_additive``)."""
    families: dict[str, list[tuple[str, float]]] = {
        "kvstrata_replica_up": [(name, float(up)) for name, up in fleet.up.items()],
        "kvstrata_replica_kv_cache_usage_ratio": [(name, s.kv_usage) for name, s in fleet.replicas.items()],
    }
    helps = {"kvstrata_replica_up": "Whether the fleet's replica serves (1) or not (0).",
             "kvstrata_replica_kv_cache_usage_ratio": "Fraction of the replica's device KV blocks in use."}
    for name, s in fleet.replicas.items():
        for key in sorted(s.extra):
            if not is_additive(key):
                metric = metric_name(key)
                families.setdefault(metric, []).append((name, s.extra[key]))
                helps.setdefault(metric, f"Engine value {key}, per replica (it does not add up).")
    for metric, series in families.items():
        lines.extend((f"# HELP {metric} {helps[metric]}", f"# TYPE {metric} gauge"))
        lines.extend(f'{metric}{{{label},replica="{_escape(r)}"}} {_fmt(v)}' for r, v in series)


_RESIDENCY_HISTOGRAMS = (
    ("lifetime_s", "kvstrata_kv_block_lifetime_seconds",
     "Sampled device KV blocks: allocation to eviction."),
    ("idle_before_eviction_s", "kvstrata_kv_block_idle_before_eviction_seconds",
     "Sampled device KV blocks: last use to eviction."),
    ("reuse_gap_s", "kvstrata_kv_block_reuse_gap_seconds",
     "Sampled device KV blocks: time between two uses (prefix hits)."),
)


def _render_residency(lines: list[str], r: BlockResidencyStats, label: str) -> None:
    gauge = _emitter(lines, "gauge", label)
    counter = _emitter(lines, "counter", label)
    gauge("kvstrata_kv_block_residency_sample_rate", "Fraction of device KV block allocations sampled.",
          r.sample_rate)
    counter("kvstrata_kv_block_residency_samples_total", "Sampled device KV blocks evicted.", r.num_samples)
    counter("kvstrata_kv_block_residency_reuses_total", "Prefix hits on sampled blocks before their eviction.",
            r.num_reuses)
    for field, name, help_text in _RESIDENCY_HISTOGRAMS:
        lines += render_histogram(name, help_text, getattr(r, field), label)


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


_FIELDS = {
    "kvstrata_num_requests_running": "num_running",
    "kvstrata_num_requests_waiting": "num_waiting",
    "kvstrata_kv_cache_usage_ratio": "kv_usage",
    "kvstrata_num_preemptions_total": "num_preemptions",
    "kvstrata_requests_finished_total": "num_finished",
    "kvstrata_prompt_tokens_total": "num_prompt_tokens",
    "kvstrata_generation_tokens_total": "num_generated_tokens",
}
_TIER_FIELDS = {"kvstrata_prefix_cache_hits_total": ("prefix_cache_hits", "hit_tokens"),
                "kvstrata_prefix_cache_queries_total": ("prefix_cache_queries", "query_tokens")}
_RESIDENCY_SCALARS = {"kvstrata_kv_block_residency_sample_rate": "sample_rate",
                      "kvstrata_kv_block_residency_samples_total": "num_samples",
                      "kvstrata_kv_block_residency_reuses_total": "num_reuses"}
_NOT_EXTRA = re.compile(r"^kvstrata_(prefix_cache_hit_rate|kv_block_|http_requests_total)")
_HIST_PART = re.compile(r"^(kvstrata_kv_block_\w+_seconds)_(bucket|sum|count)$")


def stats_from_metrics(text: str) -> EngineStats:
    """Read ``render_metrics``' page back into an EngineStats (a fleet's:
    its totals, the per-replica series left out). ``extra``
    keys come back as their gauge names without the ``kvstrata_`` prefix
    (``metric_name`` is not invertible: dots became underscores), except
    the per-tier counters, which come back as the connector's books
    (``connector.<tier>.hit_tokens``, ``connector.query_tokens``), so
    ``tier_hit_rates`` reads the page as it reads the engine."""
    fields: dict[str, int | float] = {}
    extra: dict[str, float] = {}
    residency: dict[str, Any] = {}  # Any: histogram parts and counts, read back by name
    hists: dict[str, dict[str, Any]] = {}  # Any: {le: [(bound, count)], sum, count}
    for name, labels, value in parse_metrics(text):
        if "model_name" not in labels or "replica" in labels:
            continue  # the server's own histograms; a fleet's per-replica series
        if name in _FIELDS:
            fields[_FIELDS[name]] = value if name == "kvstrata_kv_cache_usage_ratio" else int(value)
        elif name in _TIER_FIELDS:
            field, suffix = _TIER_FIELDS[name]
            tier = labels.get("tier")
            if tier == "device":
                fields[field] = int(value)
            elif suffix == "hit_tokens":
                extra[f"connector.{tier}.hit_tokens"] = value
            else:
                extra[_QUERY_KEY] = value  # the same for every store tier
        elif name in _RESIDENCY_SCALARS:
            residency[_RESIDENCY_SCALARS[name]] = value
        elif name.startswith("kvstrata_kv_block_") and (m := _HIST_PART.match(name)):
            h = hists.setdefault(m.group(1), {"le": []})
            if m.group(2) == "bucket":
                h["le"].append((float(labels["le"]), int(value)))
            else:
                h[m.group(2)] = value
        elif not _NOT_EXTRA.match(name) and name.startswith("kvstrata_"):
            extra[name[len("kvstrata_"):]] = value
    if residency:
        for field, name, _ in _RESIDENCY_HISTOGRAMS:
            residency[field] = _histogram_from(hists.get(name, {"le": []}))
        fields["block_residency"] = BlockResidencyStats(
            sample_rate=residency.get("sample_rate", 0.0), num_samples=int(residency.get("num_samples", 0)),
            num_reuses=int(residency.get("num_reuses", 0)), lifetime_s=residency["lifetime_s"],
            idle_before_eviction_s=residency["idle_before_eviction_s"], reuse_gap_s=residency["reuse_gap_s"],
        )
    return EngineStats(**fields, extra=extra)


def _histogram_from(h: dict[str, Any]) -> HistogramSnapshot:  # Any: as in hists
    """Per-bucket counts from cumulative ``le`` buckets."""
    le = sorted(h["le"])
    counts, prev = [], 0
    for _, acc in le:
        counts.append(acc - prev)
        prev = acc
    bounds = tuple(b for b, _ in le if b != float("inf"))
    return HistogramSnapshot(bounds=bounds, counts=tuple(counts), sum=float(h.get("sum", 0.0)),
                             count=int(h.get("count", 0)))


def _fmt(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
