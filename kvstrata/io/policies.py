"""Cache policies: which objects a tier evicts first.

A policy owns only its own index of keys (never the tier's bytes or dict).
The tier tells it about puts, hits and removals, and asks ``victims(n,
evictable)`` for up to n keys in eviction order; the tier then removes them
and calls ``on_remove``. ``victims`` does not change the index.

    LRU   least recently put or hit first
    MRU   most recently put or hit first
    FIFO  oldest put first; hits change nothing
    LFU   fewest hits first; among equal counts, the one that reached that
          count first (FIFO within a frequency)

``on_put`` of a key already present counts as a hit.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Protocol

Evictable = Callable[[Hashable], bool]


class CachePolicy(Protocol):
    def on_put(self, key: Hashable) -> None: ...

    def on_hit(self, key: Hashable) -> None: ...

    def on_remove(self, key: Hashable) -> None: ...

    def victims(self, n: int, evictable: Evictable | None = None) -> list[Hashable]: ...

    def __len__(self) -> int: ...


def _take(order: Iterable[Hashable], n: int, evictable: Evictable | None) -> list[Hashable]:
    out: list[Hashable] = []
    if n <= 0:
        return out
    for key in order:
        if evictable is None or evictable(key):
            out.append(key)
            if len(out) == n:
                break
    return out


class LRUPolicy:
    """Owns: an OrderedDict of keys, least recent first."""

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def on_put(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_hit(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self, n: int, evictable: Evictable | None = None) -> list[Hashable]:
        return _take(self._order, n, evictable)


class MRUPolicy(LRUPolicy):
    """Owns: an OrderedDict of keys; evicts from the most recent end."""

    __slots__ = ()

    def victims(self, n: int, evictable: Evictable | None = None) -> list[Hashable]:
        return _take(reversed(self._order), n, evictable)


class FIFOPolicy:
    """Owns: a dict of keys in put order."""

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: dict[Hashable, None] = {}

    def __len__(self) -> int:
        return len(self._order)

    def on_put(self, key: Hashable) -> None:
        self._order.setdefault(key, None)

    def on_hit(self, key: Hashable) -> None:
        pass

    def on_remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self, n: int, evictable: Evictable | None = None) -> list[Hashable]:
        return _take(self._order, n, evictable)


class LFUPolicy:
    """Owns: key -> hit count, count -> keys in arrival order, and the sorted
    list of counts in use (few distinct counts in practice, so bisect on a
    list beats a tree)."""

    __slots__ = ("_freq", "_buckets", "_counts")

    def __init__(self) -> None:
        self._freq: dict[Hashable, int] = {}
        self._buckets: dict[int, dict[Hashable, None]] = {}
        self._counts: list[int] = []

    def __len__(self) -> int:
        return len(self._freq)

    def on_put(self, key: Hashable) -> None:
        if key in self._freq:
            self.on_hit(key)
        else:
            self._add(key, 1)

    def on_hit(self, key: Hashable) -> None:
        f = self._freq.get(key)
        if f is not None:
            self._discard(key, f)
            self._add(key, f + 1)

    def on_remove(self, key: Hashable) -> None:
        f = self._freq.pop(key, None)
        if f is not None:
            self._discard(key, f)

    def victims(self, n: int, evictable: Evictable | None = None) -> list[Hashable]:
        return _take(self._iter(), n, evictable)

    def _iter(self) -> Iterator[Hashable]:
        buckets = self._buckets
        for f in self._counts:
            yield from buckets[f]

    def _add(self, key: Hashable, f: int) -> None:
        self._freq[key] = f
        bucket = self._buckets.get(f)
        if bucket is None:
            bucket = self._buckets[f] = {}
            insort(self._counts, f)
        bucket[key] = None

    def _discard(self, key: Hashable, f: int) -> None:
        bucket = self._buckets[f]
        del bucket[key]
        if not bucket:
            del self._buckets[f]
            del self._counts[bisect_left(self._counts, f)]


POLICIES: dict[str, type] = {
    "lru": LRUPolicy,
    "mru": MRUPolicy,
    "fifo": FIFOPolicy,
    "lfu": LFUPolicy,
}


def make_policy(name: str) -> CachePolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}") from None
