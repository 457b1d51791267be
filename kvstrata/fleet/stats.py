"""A fleet's counters: what adds up across replicas and what does not.

Counters (requests, tokens, hits, bytes, evictions...) add up: the fleet's
``stats()`` is their sum. Ratios, flags and point estimates do not (two
replicas at 90% KV usage are not at 180%; two available CPU tiers are not
"2.0 available"): the ones that can be are recomputed from the summed
counters (KV usage from the block counts, acceptance and failure rates from
their counts), and every other one is reported per replica only
(``FleetStats.replicas``, exported with a ``replica`` label). Which
``EngineStats.extra`` keys are which is decided here, by name
(``is_additive``), in one place.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec

from kvstrata.enginecore.spec_decode import SpecDecodeCounters
from kvstrata.types import BlockResidencyStats, EngineStats, HistogramSnapshot

# Extra keys that are not counters: flags (``store.cpu.available``), rates
# and ratios, bandwidths, latencies and costs per unit, means and maxima.
_NOT_ADDITIVE = re.compile(
    r"(?:^|[._])available$|_rate(?:\.|$)|_bps$|_latency_s$|_s_per_token$|_per_s$|overhead_s$"
    r"|(?:^|[._])mean_|(?:^|[._])max_|_observed$"
)


def is_additive(key: str) -> bool:
    """Whether an ``EngineStats.extra`` key is a count that sums across
    replicas (else a ratio, a flag or an estimate: per replica)."""
    return _NOT_ADDITIVE.search(key) is None


class FleetStats(msgspec.Struct, frozen=True, kw_only=True):
    """The replicas' stats at one moment. ``totals``: counters summed and
    ratios recomputed (None when no replica answered); ``replicas``: each
    one that answered, as it said; ``up``: every replica of the fleet,
    whether it serves."""

    totals: EngineStats | None
    replicas: dict[str, EngineStats]
    up: dict[str, bool]


def fleet_totals(parts: Mapping[str, EngineStats]) -> EngineStats:
    """The fleet's stats from its replicas' (at least one): additive fields
    and extras summed, KV usage and the known rates recomputed from the
    sums, the other non-additive extras left out (see ``FleetStats.replicas``)."""
    if not parts:
        raise ValueError("fleet_totals needs at least one replica's stats")
    stats = list(parts.values())
    extra: dict[str, float] = {}
    for s in stats:
        for k, v in s.extra.items():
            if is_additive(k):
                extra[k] = extra.get(k, 0.0) + v
    extra.update(_recomputed_rates(extra))
    return EngineStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        kv_usage=_kv_usage(stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        num_finished=sum(s.num_finished for s in stats),
        num_generated_tokens=sum(s.num_generated_tokens for s in stats),
        num_prompt_tokens=sum(s.num_prompt_tokens for s in stats),
        block_residency=_residency([s.block_residency for s in stats if s.block_residency is not None]),
        extra=extra,
    )


def _kv_usage(stats: list[EngineStats]) -> float:
    """Blocks in use over blocks, fleet-wide (each replica's usage weighted
    by its pool; equally when a replica does not say its pool's size)."""
    sizes = [s.extra.get("kv.num_blocks", 0.0) for s in stats]
    if all(n > 0 for n in sizes):
        return sum(s.kv_usage * n for s, n in zip(stats, sizes)) / sum(sizes)
    return sum(s.kv_usage for s in stats) / len(stats)


def _recomputed_rates(extra: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    if "spec.num_draft_tokens" in extra:  # the engines' own formulas, over the summed counts
        out.update(SpecDecodeCounters(num_drafts=int(extra.get("spec.num_drafts", 0.0)),
                                      num_draft_tokens=int(extra["spec.num_draft_tokens"]),
                                      num_accepted_tokens=int(extra.get("spec.num_accepted_tokens", 0.0))).as_extra())
    for key in extra:
        if key.endswith(".read_failures"):
            base = key[: -len(".read_failures")]
            reads = extra.get(f"{base}.reads", 0.0)
            out[f"{base}.read_failure_rate"] = extra[key] / reads if reads else 0.0
    return out


def _residency(parts: list[BlockResidencyStats]) -> BlockResidencyStats | None:
    if not parts:
        return None
    first = parts[0]
    return BlockResidencyStats(
        sample_rate=sum(p.sample_rate for p in parts) / len(parts),
        num_samples=sum(p.num_samples for p in parts), num_reuses=sum(p.num_reuses for p in parts),
        lifetime_s=_histogram([p.lifetime_s for p in parts]),
        idle_before_eviction_s=_histogram([p.idle_before_eviction_s for p in parts]),
        reuse_gap_s=_histogram([p.reuse_gap_s for p in parts]),
    ) if all(p.lifetime_s.bounds == first.lifetime_s.bounds for p in parts) else first


def _histogram(parts: list[HistogramSnapshot]) -> HistogramSnapshot:
    return HistogramSnapshot(bounds=parts[0].bounds, counts=tuple(map(sum, zip(*(p.counts for p in parts)))),
                             sum=sum(p.sum for p in parts), count=sum(p.count for p in parts))
