"""Store statistics: live counters per tier, exported as frozen Structs.

A hit or miss is counted by the tier asked to serve a chunk in ``get``:
L1 counts every requested chunk of the served prefix; a lower tier counts the
chunks it was asked for. ``lookup`` is counted once at the store level.
Chunks count objects (each layer key is one); tokens count a layerwise chunk
once, on its layer 0.
"""

from __future__ import annotations

import msgspec


class TierStats(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    kind: str
    available: bool = True
    hit_chunks: int = 0
    miss_chunks: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    puts: int = 0
    evictions: int = 0
    dropped_puts: int = 0
    corrupt: int = 0
    faults: int = 0
    usage_bytes: int = 0
    capacity_bytes: int = 0
    num_objects: int = 0


class StoreStats(msgspec.Struct, frozen=True, kw_only=True):
    tiers: tuple[TierStats, ...]
    lookups: int = 0
    lookup_chunks: int = 0
    lookup_hit_chunks: int = 0

    def tier(self, name: str) -> TierStats:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier named {name!r}")


class Outstanding(msgspec.Struct, frozen=True):
    """What is still held: pins, references beyond the tiers' own, pending
    I/O jobs. All zero when the store is quiescent."""

    pinned: int = 0
    referenced: int = 0
    pending_jobs: int = 0


class TierCounters:
    """Owns: one tier's running counters (mutated on the loop only)."""

    __slots__ = ("hit_chunks", "miss_chunks", "hit_tokens", "miss_tokens", "bytes_in",
                 "bytes_out", "puts", "evictions", "dropped_puts", "corrupt", "faults")

    def __init__(self) -> None:
        for f in self.__slots__:
            setattr(self, f, 0)

    def hit(self, tokens: int) -> None:
        self.hit_chunks += 1
        self.hit_tokens += tokens

    def miss(self, tokens: int) -> None:
        self.miss_chunks += 1
        self.miss_tokens += tokens

    def snapshot(self, name: str, kind: str, *, available: bool, usage_bytes: int,
                 capacity_bytes: int, num_objects: int, dropped_puts: int = 0) -> TierStats:
        return TierStats(
            name=name, kind=kind, available=available,
            hit_chunks=self.hit_chunks, miss_chunks=self.miss_chunks,
            hit_tokens=self.hit_tokens, miss_tokens=self.miss_tokens,
            bytes_in=self.bytes_in, bytes_out=self.bytes_out, puts=self.puts,
            evictions=self.evictions, dropped_puts=self.dropped_puts + dropped_puts,
            corrupt=self.corrupt, faults=self.faults, usage_bytes=usage_bytes,
            capacity_bytes=capacity_bytes, num_objects=num_objects,
        )
