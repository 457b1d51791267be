"""The store's tiers by *source*, and what they tell without I/O.

    source   0 (``L1_SOURCE``)   1          2        ...
    tier     L1 (CPU memory)     tiers[0]   tiers[1]       fastest first

Every call into a lower tier goes through ``guard`` / ``aguard``: whatever a
tier raises is counted in its ``faults``, logged, and becomes a miss (or a
dropped put); no tier fault reaches the store's caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import TypeVar

import structlog

from kvstrata.io.backends.base import LowerTier
from kvstrata.io.backends.cpu import CPUTier
from kvstrata.io.keys import ChunkKey
from kvstrata.io.memory import MemoryObj

log = structlog.get_logger(__name__)

L1_SOURCE = 0  # the source of L1; lower tier i is source i + 1
LOCAL_KINDS = frozenset({"cpu", "disk"})  # tiers whose reads have a short, known latency
Pin = tuple[ChunkKey, int]  # a pin: the key and the source that holds it
_T = TypeVar("_T")
_D = TypeVar("_D")


class Sources:
    """The StorageManager's L1, lower tiers and write-back map, read by
    source. Owns nothing: the StorageManager owns what it reads. Loop only."""

    __slots__ = ("l1", "tiers", "_flushing")

    def __init__(self, l1: CPUTier, tiers: Sequence[LowerTier], flushing: Mapping[ChunkKey, MemoryObj]) -> None:
        self.l1 = l1
        self.tiers = tiers
        self._flushing = flushing

    @property
    def names(self) -> list[str]:
        return [self.l1.name] + [t.name for t in self.tiers]

    def name(self, src: int) -> str:
        if src == L1_SOURCE:
            return self.l1.name
        return self.tiers[src - 1].name if 0 < src <= len(self.tiers) else "unknown"

    def is_local(self, src: int) -> bool:
        return src == L1_SOURCE or (0 < src <= len(self.tiers) and self.tiers[src - 1].kind in LOCAL_KINDS)

    def tier(self, src: int) -> LowerTier:
        return self.tiers[src - 1]

    def ready_in_l1(self, key: ChunkKey) -> bool:
        """Readable from memory now: in L1 and not in flight, or evicted from
        L1 and still held for a write-back."""
        l1 = self.l1
        return (l1.contains(key) and l1.in_flight(key) is None) or key in self._flushing

    def probe(self, keys: Sequence[ChunkKey]) -> tuple[list[int], bool]:
        contains, in_flight, flushing = self.l1.contains, self.l1.in_flight, self._flushing  # per key: hot
        srcs: list[int] = []
        for key in keys:
            if (contains(key) and in_flight(key) is None) or key in flushing:  # ``ready_in_l1``
                srcs.append(L1_SOURCE)
                continue
            src, known = self._lower(key)
            if src is None:
                return srcs, known
            srcs.append(src)
        return srcs, True

    def _lower(self, key: ChunkKey) -> tuple[int | None, bool]:
        for i, tier in enumerate(self.tiers):
            if not tier.available:
                continue
            has = guard(tier, "has", partial(tier.has, key), False)  # a broken tier is a miss
            if has is True:
                return i + 1, True
            if has is None:
                return None, False
        return None, True

    def holds(self, key: ChunkKey) -> bool:
        if self.l1.contains(key):
            return True
        return any(t.available and guard(t, "has", partial(t.has, key), False) is True for t in self.tiers)

    def take(self, key: ChunkKey) -> MemoryObj | None:
        """The object in L1 (ready or in flight) or held for a write-back,
        with a reference for the caller."""
        obj = self.l1.take(key)
        if obj is None and (obj := self._flushing.get(key)) is not None:
            obj.ref_up()
        return obj

    def take_ready(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        in_flight, take, flushing = self.l1.in_flight, self.l1.take, self._flushing  # per key: hot
        objs: list[MemoryObj] = []
        for key in keys:
            if in_flight(key) is not None:
                break
            obj = take(key)
            if obj is None:  # ``take``, inlined
                obj = flushing.get(key)
                if obj is None:
                    break
                obj.ref_up()
            objs.append(obj)
        return objs

    def count(self, keys: Sequence[ChunkKey], srcs: Sequence[int], served: int) -> None:
        """Hits and misses of one read: each served chunk missed every source
        before its own; the first unserved one missed them all."""
        counters = [self.l1.counters] + [t.counters for t in self.tiers]
        for i in range(served):
            tokens = _tokens(keys[i])
            for c in counters[: srcs[i]]:
                c.miss(tokens)
            counters[srcs[i]].hit(tokens)
        if served < len(keys):
            for c in counters:
                c.miss(_tokens(keys[served]))

    def pin(self, key: ChunkKey, src: int) -> bool:
        if src == L1_SOURCE:
            return self.l1.pin(key)
        tier = self.tier(src)
        return bool(guard(tier, "pin", partial(tier.pin, key), False))

    def unpin(self, key: ChunkKey, src: int) -> None:
        if src == L1_SOURCE:
            self.l1.unpin(key)
        else:
            tier = self.tier(src)
            guard(tier, "unpin", partial(tier.unpin, key), None)


def _tokens(key: ChunkKey) -> int:
    """Tokens a chunk counts for: a layerwise chunk counts them on layer 0."""
    return key.num_tokens if key.layer <= 0 else 0


def guard(tier: LowerTier, op: str, call: Callable[[], _T], default: _D) -> _T | _D:
    """Call into a tier; a bug in it (anything it raised) is logged and
    treated as a miss or a dropped put (``default``), never passed on."""
    try:
        return call()
    except Exception:
        tier.counters.faults += 1
        log.exception("tier_error", tier=tier.name, op=op)
        return default


async def aguard(tier: LowerTier, op: str, aw: Awaitable[_T], default: _D) -> _T | _D:
    try:
        return await aw
    except Exception:
        tier.counters.faults += 1
        log.exception("tier_error", tier=tier.name, op=op)
        return default


def submit_put(tier: LowerTier, key: ChunkKey, obj: MemoryObj) -> asyncio.Future | None:
    """Queue a write unless the tier already knows it has the key."""
    return guard(tier, "submit_put", lambda: None if tier.has(key) is True else tier.submit_put(key, obj), None)
