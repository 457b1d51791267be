"""Prefix-cache statistics and sampled block residency.

One count, kept by the KV cache manager: a lookup (``get_computed_blocks``)
is counted when ``allocate_slots`` takes its answer, i.e. when the request
(new, or preempted and starting over) gets its first blocks with that hit;
a lookup the scheduler retries (no room yet, or the connector cannot answer
yet) is counted once. ``queries`` counts the tokens of those requests,
``hits`` the tokens found (a request that skips the lookup, or a manager
with caching off, adds nothing). A preempted request looks up again when it
resumes; its tokens are counted apart (``preempted_*``) so resumptions,
which hit almost always, do not inflate the hit rate of fresh requests.

The collector counts since start (``totals``, what the engine reports);
``snapshot`` gives the counts since the previous snapshot (vLLM's
per-interval stats), derived from the totals.

Residency is sampled: a fraction ``sample_rate`` of block allocations
(default 1%) is followed until the block is evicted, giving its lifetime
(allocation to eviction), the idle time before eviction (last access to
eviction) and the gaps between reuses (prefix hits). Sampling picks blocks
with a geometric skip counter, so an allocation batch costs O(1) unless it
contains a sampled block; the per-block state lives in the block's
``sample`` slot. Each finished sample is folded into histograms since start
(``ResidencySampler.totals``, reported as ``kvstrata.types.BlockResidencyStats``)
and kept for the next interval snapshot.
"""

from __future__ import annotations

import bisect
import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence

import msgspec

from kvstrata.kv.block import KVCacheBlock
from kvstrata.types import BlockResidencyStats, HistogramSnapshot

MAX_REUSE_GAPS = 32
#: Bucket bounds (seconds) of the residency histograms: blocks live from
#: milliseconds (a busy pool) to hours (an idle one).
RESIDENCY_BUCKETS_S = (0.01, 0.1, 1.0, 10.0, 60.0, 300.0, 1800.0, 3600.0)


class BlockResidencySample(msgspec.Struct, frozen=True, kw_only=True):
    """One sampled block's life, ended by its eviction (seconds)."""

    lifetime_s: float
    idle_before_eviction_s: float
    num_reuses: int
    reuse_gaps_s: list[float] = []


class PrefixCacheStats(msgspec.Struct, frozen=True, kw_only=True):
    """Prefix-cache counters over a span (since start, or since the previous
    snapshot), in tokens (requests for ``*requests``). ``resets`` counts
    prefix-cache resets in the span; ``residency`` holds the block samples
    that ended in it (snapshots only)."""

    resets: int = 0
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    residency: list[BlockResidencySample] = []

    @property
    def reset(self) -> bool:
        """True if the prefix cache was reset in the span."""
        return self.resets > 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


_COUNTERS = ("resets", "requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits")


class PrefixCacheStatsCollector:
    """Owns: the prefix-cache counters since start, and the totals at the
    previous snapshot (from which a snapshot's counts are derived)."""

    __slots__ = (*_COUNTERS, "_mark")

    def __init__(self) -> None:
        for name in _COUNTERS:
            setattr(self, name, 0)
        self._mark = PrefixCacheStats()

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    def totals(self) -> PrefixCacheStats:
        """The counters since start."""
        return PrefixCacheStats(**{name: getattr(self, name) for name in _COUNTERS})

    def snapshot(self, residency: list[BlockResidencySample]) -> PrefixCacheStats:
        """The counters since the previous snapshot (then this one is the mark)."""
        now, mark = self.totals(), self._mark
        self._mark = now
        return PrefixCacheStats(
            **{name: getattr(now, name) - getattr(mark, name) for name in _COUNTERS}, residency=residency
        )


class _Histogram:
    """Owns: per-bucket counts, sum and count of one quantity (seconds)."""

    __slots__ = ("counts", "sum", "count")

    def __init__(self) -> None:
        self.counts = [0] * (len(RESIDENCY_BUCKETS_S) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(RESIDENCY_BUCKETS_S, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(bounds=RESIDENCY_BUCKETS_S, counts=tuple(self.counts), sum=self.sum,
                                 count=self.count)


class ResidencyTotals:
    """Owns: the residency histograms since start (every finished sample is
    folded in as it ends)."""

    __slots__ = ("num_samples", "num_reuses", "lifetime", "idle", "reuse_gap")

    def __init__(self) -> None:
        self.num_samples = 0
        self.num_reuses = 0
        self.lifetime = _Histogram()
        self.idle = _Histogram()
        self.reuse_gap = _Histogram()

    def add(self, sample: BlockResidencySample) -> None:
        self.num_samples += 1
        self.num_reuses += sample.num_reuses
        self.lifetime.observe(sample.lifetime_s)
        self.idle.observe(sample.idle_before_eviction_s)
        for gap in sample.reuse_gaps_s:
            self.reuse_gap.observe(gap)

    def snapshot(self, sample_rate: float) -> BlockResidencyStats:
        return BlockResidencyStats(
            sample_rate=sample_rate, num_samples=self.num_samples, num_reuses=self.num_reuses,
            lifetime_s=self.lifetime.snapshot(), idle_before_eviction_s=self.idle.snapshot(),
            reuse_gap_s=self.reuse_gap.snapshot(),
        )


class _Residency:
    """Live state of one sampled block (kept in ``KVCacheBlock.sample``)."""

    __slots__ = ("birth", "last_access", "gaps", "num_reuses")

    def __init__(self, now: float) -> None:
        self.birth = now
        self.last_access = now
        self.gaps: list[float] = []
        self.num_reuses = 0


class ResidencySampler:
    """Owns: the sampling schedule, the histograms of every finished sample
    (``totals``) and the samples finished since the last ``take_samples``
    (a bounded buffer; the oldest are dropped when nobody drains it). The
    live per-block state sits in the sampled blocks themselves."""

    __slots__ = ("sample_rate", "totals", "_rng", "_clock", "_skip", "_log_q", "_done")

    def __init__(
        self,
        sample_rate: float,
        *,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_samples: int = 4096,
    ) -> None:
        if not isinstance(sample_rate, (int, float)) or not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"metrics_sample_rate must be in (0, 1], got {sample_rate!r}")
        self.sample_rate = float(sample_rate)
        self._rng = random.Random(seed)
        self._clock = clock
        self._log_q = math.log1p(-self.sample_rate) if self.sample_rate < 1.0 else 0.0
        self._done: deque[BlockResidencySample] = deque(maxlen=max_samples)
        self.totals = ResidencyTotals()
        self._skip = self._draw_skip()

    def _draw_skip(self) -> int:
        """Allocations to pass over before the next sampled one (geometric)."""
        if self._log_q == 0.0:
            return 0
        u = 1.0 - self._rng.random()  # (0, 1]
        return int(math.log(u) / self._log_q)

    def on_allocated(self, blocks: Sequence[KVCacheBlock]) -> None:
        n = len(blocks)
        skip = self._skip
        if skip >= n:
            self._skip = skip - n
            return
        now = self._clock()
        i = skip
        while i < n:
            blocks[i].sample = _Residency(now)
            i += 1 + self._draw_skip()
        self._skip = i - n

    def on_touched(self, block: KVCacheBlock) -> None:
        s: _Residency = block.sample  # type: ignore[assignment]
        now = self._clock()
        if len(s.gaps) < MAX_REUSE_GAPS:
            s.gaps.append(now - s.last_access)
        s.last_access = now
        s.num_reuses += 1

    def on_evicted(self, block: KVCacheBlock) -> None:
        s: _Residency = block.sample  # type: ignore[assignment]
        block.sample = None
        now = self._clock()
        sample = BlockResidencySample(
            lifetime_s=now - s.birth,
            idle_before_eviction_s=now - s.last_access,
            num_reuses=s.num_reuses,
            reuse_gaps_s=s.gaps,
        )
        self._done.append(sample)
        self.totals.add(sample)

    def take_samples(self) -> list[BlockResidencySample]:
        out = list(self._done)
        self._done.clear()
        return out
