"""Prefix-cache statistics and sampled block residency.

Hit rate denominators: ``queries`` counts the tokens of every request that
*looked up* the cache (a request that skips the lookup, or a manager with
caching off, adds nothing), ``hits`` the tokens found. A preempted request
looks up again when it resumes; its tokens are counted apart
(``preempted_*``) so resumptions, which hit almost always, do not inflate the
hit rate of fresh requests.

Residency is sampled: a fraction ``sample_rate`` of block allocations
(default 1%) is followed until the block is evicted, giving its lifetime
(allocation to eviction), the idle time before eviction (last access to
eviction) and the gaps between reuses (prefix hits). Sampling picks blocks
with a geometric skip counter, so an allocation batch costs O(1) unless it
contains a sampled block; the per-block state lives in the block's
``sample`` slot.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence

import msgspec

from kvstrata.kv.block import KVCacheBlock

MAX_REUSE_GAPS = 32


class BlockResidencySample(msgspec.Struct, frozen=True, kw_only=True):
    """One sampled block's life, ended by its eviction (seconds)."""

    lifetime_s: float
    idle_before_eviction_s: float
    num_reuses: int
    reuse_gaps_s: list[float] = []


class PrefixCacheStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counters since the previous snapshot, in tokens (requests for
    ``requests``). ``reset`` is True if the prefix cache was reset since."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    residency: list[BlockResidencySample] = []

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PrefixCacheStatsCollector:
    """Owns: the running prefix-cache counters between two snapshots."""

    __slots__ = ("reset", "requests", "queries", "hits", "p_requests", "p_queries", "p_hits")

    def __init__(self) -> None:
        self._zero()

    def _zero(self) -> None:
        self.reset = False
        self.requests = self.queries = self.hits = 0
        self.p_requests = self.p_queries = self.p_hits = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.p_requests += 1
            self.p_queries += num_tokens
            self.p_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    def snapshot(self, residency: list[BlockResidencySample]) -> PrefixCacheStats:
        """Return the counters so far and start again from zero."""
        stats = PrefixCacheStats(
            reset=self.reset,
            requests=self.requests,
            queries=self.queries,
            hits=self.hits,
            preempted_requests=self.p_requests,
            preempted_queries=self.p_queries,
            preempted_hits=self.p_hits,
            residency=residency,
        )
        self._zero()
        return stats


class _Residency:
    """Live state of one sampled block (kept in ``KVCacheBlock.sample``)."""

    __slots__ = ("birth", "last_access", "gaps", "num_reuses")

    def __init__(self, now: float) -> None:
        self.birth = now
        self.last_access = now
        self.gaps: list[float] = []
        self.num_reuses = 0


class ResidencySampler:
    """Owns: the sampling schedule and the finished samples (a bounded
    buffer; the oldest are dropped when nobody drains it). The live
    per-block state sits in the sampled blocks themselves."""

    __slots__ = ("sample_rate", "_rng", "_clock", "_skip", "_log_q", "_done")

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
        self._done.append(
            BlockResidencySample(
                lifetime_s=now - s.birth,
                idle_before_eviction_s=now - s.last_access,
                num_reuses=s.num_reuses,
                reuse_gaps_s=s.gaps,
            )
        )

    def take_samples(self) -> list[BlockResidencySample]:
        out = list(self._done)
        self._done.clear()
        return out
