"""Admission into the KV tiers: should a chunk be stored at all?

A save costs a copy out of the device cache, L1 room (an eviction when L1 is
full) and the writes to the lower tiers; it pays back only if some later
request reads the chunk. A chunk asked for once (a one-off prompt) never
pays back, and when it passes through a small L1 it evicts a chunk that
would have. TinyLFU (Einziger, Friedman, Manes 2017) keeps the cache for
what recurs, with a small approximate record of recent frequency::

    record(key)            a request asked for the chunk
                             doorkeeper bit clear -> set it (first sighting)
                             else                 -> +1 in each of `depth` rows
    estimate(key)          min over the rows (count-min) + the doorkeeper bit
    every `sample_size`    halve every counter, clear the doorkeeper
    records ("reset")      (frequency ages: what recurs *now* counts)

           row 0 |  |3 |  |  |1 |  |   one 4-bit-range counter per cell,
           row 1 |1 |  |  |3 |  |  |   saturating at 15
           row 2 |  |  |3 |  |  |2 |   estimate = min(3, 3, 3) + doorkeeper

The estimate never under-counts the records since the last reset (while
below the counter ceiling): a collision only adds. One-hit wonders stay in
the doorkeeper (one bit each) and never reach the counters.

``AdmissionPolicy.admit(candidate, victim)``:

    victim given (L1 must evict it to make room)  admit iff the candidate's
                                                  estimate is at least the
                                                  victim's (ties: the newer)
    no victim (free room)                         admit iff estimate >= min_seen

``inherited`` lets the caller lend a candidate the frequency of something it
belongs to (the connector lends a multi-turn conversation's new chunks the
frequency of the history they extend, see
``kvstrata.connector.offload.saves``).

Keys are ``ChunkKey``s; their ``prefix_hash`` is already a cryptographic
digest of the whole prefix, so it is read as integers, never hashed again
(short hashes are spread with splitmix64). Pure and deterministic: no I/O,
no clock, no process-seeded ``hash()``; O(depth) per call; memory fixed at
construction (``nbytes``).
"""

from __future__ import annotations

from kvstrata.io.keys import ChunkKey

_M64 = (1 << 64) - 1
MAX_COUNT = 15  # a counter's ceiling (TinyLFU's 4-bit counters)
_HALVE = bytes(v >> 1 for v in range(256))


def _mix64(x: int) -> int:
    """splitmix64's finalizer: spreads a 64-bit value over all its bits."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


def key_hashes(key: ChunkKey) -> tuple[int, int]:
    """Two independent 64-bit values from the key's digest (double hashing:
    row i uses h1 + i * h2). The token count and layer are folded in, so a
    partial chunk or a layer key is not its chunk."""
    h = key.prefix_hash
    lo = int.from_bytes(h[:8], "little")
    hi = int.from_bytes(h[8:16], "little") if len(h) > 8 else _mix64(lo ^ 0x9E3779B97F4A7C15)
    extra = (key.num_tokens << 8) ^ (key.layer + 1)
    return _mix64(lo ^ extra), _mix64(hi + extra) | 1  # h2 odd: rows never coincide


def _pow2_at_least(n: int) -> int:
    return 1 << max(4, (n - 1).bit_length())


class FrequencySketch:
    """Owns: the count-min rows (one byte per counter, saturating at
    ``MAX_COUNT``), the doorkeeper bloom filter and the records since the
    last reset.

    ``capacity``: about how many distinct keys matter at once (the cache's
    size in chunks); the width is the next power of two at or above it, the
    doorkeeper has 8 bits per key, and the window (``sample_size``) is
    ``sample_factor * width`` records.
    """

    __slots__ = ("depth", "width", "sample_size", "resets", "_rows", "_door", "_door_bits", "_records")

    def __init__(self, capacity: int, *, depth: int = 4, sample_factor: int = 10) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")
        if not isinstance(depth, int) or not 1 <= depth <= 8:
            raise ValueError(f"depth must be an integer in [1, 8], got {depth!r}")
        if not isinstance(sample_factor, int) or sample_factor < 1:
            raise ValueError(f"sample_factor must be an integer >= 1, got {sample_factor!r}")
        self.depth = depth
        self.width = _pow2_at_least(capacity)
        self.sample_size = sample_factor * self.width
        self.resets = 0
        self._rows = [bytearray(self.width) for _ in range(depth)]
        self._door_bits = 8 * self.width
        self._door = bytearray(self._door_bits // 8)
        self._records = 0

    @property
    def nbytes(self) -> int:
        """Memory held by the counters and the doorkeeper (fixed)."""
        return self.depth * self.width + len(self._door)

    # -- the doorkeeper: a bloom filter of two probes ------------------------------
    def _door_probes(self, h1: int, h2: int) -> tuple[int, int]:
        m = self._door_bits - 1  # a power of two
        return h1 & m, (h1 + h2) >> 7 & m

    def _in_door(self, h1: int, h2: int) -> bool:
        a, b = self._door_probes(h1, h2)
        door = self._door
        return bool(door[a >> 3] & (1 << (a & 7))) and bool(door[b >> 3] & (1 << (b & 7)))

    def _add_door(self, h1: int, h2: int) -> None:
        a, b = self._door_probes(h1, h2)
        door = self._door
        door[a >> 3] |= 1 << (a & 7)
        door[b >> 3] |= 1 << (b & 7)

    # -- counters --------------------------------------------------------------------
    def _cells(self, h1: int, h2: int) -> list[int]:
        a, b, m = h1 >> 32, h2 >> 32 | 1, self.width - 1  # high bits: the doorkeeper reads the low ones
        return [(a + i * b) & m for i in range(self.depth)]

    def _count(self, h1: int, h2: int) -> int:
        return min(row[c] for row, c in zip(self._rows, self._cells(h1, h2)))

    def record(self, key: ChunkKey) -> None:
        """One request asked for ``key``."""
        h1, h2 = key_hashes(key)
        if not self._in_door(h1, h2):
            self._add_door(h1, h2)
        else:
            cells = self._cells(h1, h2)
            rows = self._rows
            low = min(row[c] for row, c in zip(rows, cells))
            if low < MAX_COUNT:  # conservative update: raise only the minimal cells
                for row, c in zip(rows, cells):
                    if row[c] == low:
                        row[c] = low + 1
        self._records += 1
        if self._records >= self.sample_size:
            self.reset()

    def estimate(self, key: ChunkKey) -> int:
        """Records of ``key`` since the last reset, never fewer (up to the
        counter ceiling + 1); halved at each reset."""
        h1, h2 = key_hashes(key)
        return self._count(h1, h2) + (1 if self._in_door(h1, h2) else 0)

    def reset(self) -> None:
        """Age the record: halve every counter, clear the doorkeeper."""
        for row in self._rows:
            row[:] = row.translate(_HALVE)
        self._door[:] = bytes(len(self._door))
        self._records //= 2
        self.resets += 1


class AdmissionPolicy:
    """TinyLFU admission over a ``FrequencySketch``.

    Owns: the sketch and the decision counters (``admitted``, ``rejected``).
    """

    __slots__ = ("sketch", "min_seen", "admitted", "rejected")

    def __init__(self, capacity: int, *, min_seen: int = 2, depth: int = 4, sample_factor: int = 10) -> None:
        if not isinstance(min_seen, int) or min_seen < 0:
            raise ValueError(f"min_seen must be an integer >= 0, got {min_seen!r}")
        self.sketch = FrequencySketch(capacity, depth=depth, sample_factor=sample_factor)
        self.min_seen = min_seen
        self.admitted = 0
        self.rejected = 0

    def record(self, key: ChunkKey) -> None:
        self.sketch.record(key)

    def estimate(self, key: ChunkKey) -> int:
        return self.sketch.estimate(key)

    def admit(self, candidate: ChunkKey, victim: ChunkKey | None = None, *, inherited: int = 0) -> bool:
        """Store ``candidate``? With a ``victim`` (what storing it would
        evict): only if its frequency (at least ``inherited``) is at least the
        victim's (a tie goes to the newer chunk, as in an LRU: what a proven
        chunk is protected from is a less frequent one); with none (free
        room): if it reaches ``min_seen``."""
        freq = max(self.sketch.estimate(candidate), inherited)
        ok = freq >= self.sketch.estimate(victim) if victim is not None else freq >= self.min_seen
        if ok:
            self.admitted += 1
        else:
            self.rejected += 1
        return ok
