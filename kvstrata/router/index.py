"""Which replica holds which block, per medium, fed by the engines' KV events.

The router's view of every replica's cache: a block hash (a chain hash, so
it names the block *and* everything before it) maps to the replicas that
hold it on each medium. Media, best first::

    lane 0  GPU      the device pool ("device" / None / "GPU" in events)
    lane 1  CPU      L1
    lane 2  DISK     local disk tiers
    lane 3  REMOTE   Redis, shared fs: with ``shared_remote`` a REMOTE copy
                     reported by any replica counts for every replica

Layout, chosen so a 512-block prefix walk runs in C (``map`` + ``accumulate``
+ ``takewhile``) instead of a Python loop: one int per hash with four lanes
of ``max_replicas`` bits, bit ``lane * W + slot``. The lanes are cumulative,
"held on this medium or a better one"::

    lane 0 = GPU           lane 1 = GPU|CPU
    lane 2 = GPU|CPU|DISK  lane 3 = GPU|CPU|DISK|REMOTE (all ones if shared)

The running AND of the hashes' ints along a request's chain only loses bits,
so bit ``lane * W + slot`` survives exactly as many blocks as that replica's
prefix hit on that lane: the device hit (lane 0, as the engine's own lookup
stops at the first device miss) and the tier hits beyond it. The walk stops
as soon as no live replica has any lane left; :meth:`PrefixIndex.prefix_blocks_lazy`
walks a :class:`kvstrata.router.hashes.PromptChain` that hashes a block only
when the walk reaches it.

Hash kinds: events carry bytes hashes, or vLLM-style int hashes (the low 64
bits, ``cache.kv_events_int_hashes``). The first int hash seen switches the
index to 8-byte keys (the last 8 bytes of every hash, big-endian: the same
64 bits): every key held is cut once, and from then on every hash stored,
removed, credited or looked up is cut to its last 8 bytes.

Sequence numbers and epochs: a replica's batches carry the publisher's
sequence number (``kvstrata.ipc.kv_publisher``: from 0, no gaps). A batch
after a gap is not applied (applying it before the missed ones could bring
back a removed block); :meth:`PrefixIndex.ingest` returns the rebuild to do
("replay" from the expected number, or "snapshot" when the gap is wider than
the engine's replay ring) and the caller does the I/O. An engine start
brings a new epoch: :meth:`PrefixIndex.reset_replica` drops every block of
the old one, and batches tagged with another epoch are refused.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate, repeat, takewhile
from operator import and_, itemgetter, neg
from typing import TYPE_CHECKING

import msgspec

from kvstrata.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

if TYPE_CHECKING:
    from kvstrata.router.hashes import PromptChain

# The media of kvstrata.connector.events (GPU, CPU, DISK, REMOTE; written out
# here so the router does not import the connector, which pulls in torch).
GPU, CPU, DISK, REMOTE = "GPU", "CPU", "DISK", "REMOTE"
MEDIA = (GPU, CPU, DISK, REMOTE)
_LANE_OF = {GPU: 0, "device": 0, None: 0, "gpu": 0, CPU: 1, "cpu": 1, DISK: 2, "disk": 2, REMOTE: 3, "remote": 3}
NUM_LANES = 4
_LAST8 = itemgetter(slice(-8, None))
_MASK64 = (1 << 64) - 1


class IngestResult(msgspec.Struct, frozen=True, kw_only=True):
    """What :meth:`PrefixIndex.ingest` did with one batch.

    ``action``: "applied"; "duplicate" (already applied: a replay overlap);
    "gap" (not applied: batches are missing, ``rebuild`` says how to get
    them back, starting at ``expected_seq``); "stale_epoch" (from an engine
    that has since restarted); "unknown_replica".
    """

    action: str
    replica: str
    seq: int
    expected_seq: int | None = None
    rebuild: str | None = None  # "replay" | "snapshot" when action == "gap"


class IndexCounters(msgspec.Struct, kw_only=True):
    batches: int = 0
    block_events: int = 0  # hashes stored or removed, over all applied batches
    gaps: int = 0
    duplicates: int = 0
    stale_epoch: int = 0
    unknown_replica: int = 0
    ignored_events: int = 0  # an unknown medium, or a group other than 0
    predicted: int = 0  # hashes credited at dispatch, ahead of the engine's events
    withdrawn: int = 0  # credits withdrawn when their request settled without the engine reporting the block


class _Replica:
    __slots__ = ("replica_id", "slot", "epoch", "next_seq", "held", "provisional", "predictions")

    def __init__(self, replica_id: str, slot: int, epoch: int) -> None:
        self.replica_id = replica_id
        self.slot = slot
        self.epoch = epoch
        self.next_seq: int | None = None  # None: no batch seen yet in this epoch
        self.held: list[set[bytes]] = [set() for _ in range(NUM_LANES)]  # as the engine's events report
        self.provisional: dict[bytes, int] = {}  # device hashes credited at dispatch -> requests in flight
        self.predictions: dict[str, list[bytes]] = {}  # request key -> the hashes credited for it


class PrefixIndex:
    """Owns: the replica slots (id, epoch, next expected sequence number,
    the hashes held per medium) and the two hash maps, ``_raw`` (per-medium
    bits) and ``_packed`` (the cumulative lanes the walk reads).

    Invariant: for every hash h and medium m, bit ``m * W + slot`` of
    ``_raw[h]`` is set iff h is in that slot's ``held[m]``, or m is the
    device and h is in its ``provisional`` (credited to a request in flight,
    :meth:`predict`); ``_packed[h]`` is ``_pack(_raw[h])``; no entry is 0.
    """

    def __init__(self, *, max_replicas: int = 64, shared_remote: bool = True, replay_window: int = 10_000) -> None:
        if not isinstance(max_replicas, int) or max_replicas < 1:
            raise ValueError(f"max_replicas must be an integer >= 1, got {max_replicas!r}")
        if not isinstance(replay_window, int) or replay_window < 1:
            raise ValueError(f"replay_window must be an integer >= 1, got {replay_window!r}")
        self.width = max_replicas
        self.shared_remote = shared_remote
        self.replay_window = replay_window  # the engine's replay ring (ZmqEventPublisher.buffer_steps)
        self._full = (1 << max_replicas) - 1
        self._raw: dict[bytes, int] = {}
        self._packed: dict[bytes, int] = {}
        self._replicas: dict[str, _Replica] = {}
        self._slots: list[_Replica | None] = []
        self.counters = IndexCounters()
        self.low64 = False  # keys are the hashes' last 8 bytes (int hashes seen)

    # -- replicas ---------------------------------------------------------------

    def reset_replica(self, replica: str, epoch: int) -> int:
        """Start (or restart) ``replica`` at ``epoch``: every block it held is
        dropped, and its next batch must be sequence number 0. Returns its slot."""
        rep = self._replicas.get(replica)
        if rep is None:
            slot = next((i for i, r in enumerate(self._slots) if r is None), len(self._slots))
            if slot >= self.width:
                raise ValueError(f"cannot add replica {replica!r}: max_replicas ({self.width}) are registered")
            rep = _Replica(replica, slot, epoch)
            if slot == len(self._slots):
                self._slots.append(rep)
            else:
                self._slots[slot] = rep
            self._replicas[replica] = rep
            return slot
        self._clear_replica(rep)
        rep.epoch = epoch
        rep.next_seq = None
        return rep.slot

    def remove_replica(self, replica: str) -> None:
        """Forget ``replica`` and every block it held; its slot is reused."""
        rep = self._replicas.pop(replica, None)
        if rep is None:
            return
        self._clear_replica(rep)
        self._slots[rep.slot] = None

    def slot(self, replica: str) -> int:
        rep = self._replicas.get(replica)
        if rep is None:
            raise KeyError(f"unknown replica {replica!r}; known: {sorted(self._replicas)}")
        return rep.slot

    def replica_at(self, slot: int) -> str:
        rep = self._slots[slot]
        assert rep is not None
        return rep.replica_id

    @property
    def replicas(self) -> list[str]:
        return [r.replica_id for r in self._slots if r is not None]

    def epoch(self, replica: str) -> int:
        return self._replicas[replica].epoch

    def expected_seq(self, replica: str) -> int | None:
        """The sequence number the next applied batch must carry (None: any
        first batch numbered 0)."""
        return self._replicas[replica].next_seq

    def held(self, replica: str, medium: str) -> frozenset[bytes]:
        """The hashes ``replica`` holds on ``medium`` by its events (tests, debugging)."""
        return frozenset(self._replicas[replica].held[_LANE_OF[medium]])

    def provisional(self, replica: str) -> frozenset[bytes]:
        """The device hashes credited to ``replica``'s requests in flight (tests, debugging)."""
        return frozenset(self._replicas[replica].provisional)

    def __len__(self) -> int:
        return len(self._raw)

    # -- events -----------------------------------------------------------------

    def ingest(self, replica: str, seq: int, batch: KVEventBatch, *, epoch: int | None = None) -> IngestResult:
        """Apply one batch from ``replica`` if it is the next in sequence.
        ``epoch``: the epoch of the engine that sent it, when the caller knows
        it; a batch of another epoch than the current one is refused."""
        c = self.counters
        rep = self._replicas.get(replica)
        if rep is None:
            c.unknown_replica += 1
            return IngestResult(action="unknown_replica", replica=replica, seq=seq)
        if epoch is not None and epoch != rep.epoch:
            c.stale_epoch += 1
            return IngestResult(action="stale_epoch", replica=replica, seq=seq, expected_seq=rep.next_seq)
        expected = 0 if rep.next_seq is None else rep.next_seq
        if seq < expected:
            c.duplicates += 1
            return IngestResult(action="duplicate", replica=replica, seq=seq, expected_seq=expected)
        if seq > expected:
            c.gaps += 1
            rebuild = "replay" if seq - expected <= self.replay_window else "snapshot"
            return IngestResult(action="gap", replica=replica, seq=seq, expected_seq=expected, rebuild=rebuild)
        self._apply(rep, batch)
        rep.next_seq = seq + 1
        c.batches += 1
        return IngestResult(action="applied", replica=replica, seq=seq, expected_seq=seq + 1)

    def load_snapshot(self, replica: str, epoch: int, next_seq: int, batch: KVEventBatch) -> None:
        """Replace everything known of ``replica`` by a snapshot: the blocks
        ``batch`` stores, consistent with the stream up to ``next_seq - 1``."""
        self.reset_replica(replica, epoch)
        rep = self._replicas[replica]
        self._apply(rep, batch)
        rep.next_seq = next_seq

    def predict(self, replica: str, hashes: list[bytes], key: str) -> None:
        """Credit ``replica`` with ``hashes`` on its device ahead of its events:
        request ``key`` was just sent there and its prompt's blocks will be
        cached once prefilled (a burst of requests sharing a new prefix then
        follows the first one instead of spreading the prefix over every
        replica). The credit lasts while the request is in flight: when it
        settles (:meth:`settle`: finished, failed, aborted), the hashes the
        engine's events have not reported are withdrawn, so a request that
        never cached its prompt (aborted early, an engine without prefix
        caching) leaves nothing behind. Predicting a key again replaces its
        credit; an engine restart (a new epoch) drops every credit."""
        rep = self._replicas.get(replica)
        if rep is None or not hashes:
            return
        if key in rep.predictions:
            self.settle(replica, key)
        hashes = list(map(_LAST8, hashes)) if self.low64 else list(hashes)
        rep.predictions[key] = hashes
        prov, held, raw, packed, pack = rep.provisional, rep.held[0], self._raw, self._packed, self._pack
        bit = 1 << rep.slot
        for h in hashes:
            n = prov.get(h, 0)
            prov[h] = n + 1
            if not n and h not in held:
                v = raw.get(h, 0) | bit
                raw[h] = v
                packed[h] = pack(v)
        self.counters.predicted += len(hashes)

    def settle(self, replica: str, key: str) -> int:
        """Request ``key`` on ``replica`` is over: withdraw its credit from
        the hashes no other request in flight there holds and the engine has
        not reported. Returns how many were withdrawn (0 for an unknown key
        or replica, or after a restart dropped the credit)."""
        rep = self._replicas.get(replica)
        hashes = rep.predictions.pop(key, None) if rep is not None else None
        if not hashes:
            return 0
        prov, held, keep, n = rep.provisional, rep.held[0], ~(1 << rep.slot), 0
        for h in hashes:
            c = prov[h] - 1
            if c:
                prov[h] = c
                continue
            del prov[h]
            if h not in held:
                self._drop_bit(h, keep)
                n += 1
        self.counters.withdrawn += n
        return n

    def _apply(self, rep: _Replica, batch: KVEventBatch) -> None:
        c = self.counters
        for ev in batch.events:
            lane = _LANE_OF.get(ev.medium, -1)
            kind = type(ev)
            if lane < 0 or (kind is not AllBlocksCleared and ev.group_idx not in (0, None)):
                c.ignored_events += 1  # another group's copy of the same hashes, or a medium we do not know
                continue
            if kind is BlockStored:
                self._store(rep, lane, self._keys(ev.block_hashes))
                c.block_events += len(ev.block_hashes)
            elif kind is BlockRemoved:
                self._remove(rep, lane, self._keys(ev.block_hashes))
                c.block_events += len(ev.block_hashes)
            elif kind is AllBlocksCleared:
                self._clear_lane(rep, lane)
            else:
                c.ignored_events += 1

    def _keys(self, hashes: list) -> list[bytes]:
        """An event's hashes as index keys (int hashes: 8 bytes, big-endian)."""
        if not hashes:
            return hashes
        if type(hashes[0]) is int and not self.low64:
            self._to_low64()
        if not self.low64:
            return hashes
        return [(h & _MASK64).to_bytes(8, "big") if type(h) is int else h[-8:] for h in hashes]

    def _to_low64(self) -> None:
        """Switch to 8-byte keys: every key held is cut (keys that now
        collide merge, as they would in the engines' int hashes)."""
        self.low64 = True
        raw: dict[bytes, int] = {}
        for h, v in self._raw.items():
            k = h[-8:]
            raw[k] = raw.get(k, 0) | v
        self._raw = raw
        self._packed = {k: self._pack(v) for k, v in raw.items()}
        for rep in self._replicas.values():
            rep.held = [set(map(_LAST8, held)) for held in rep.held]
            prov: dict[bytes, int] = {}
            for h, n in rep.provisional.items():
                prov[h[-8:]] = prov.get(h[-8:], 0) + n
            rep.provisional = prov
            rep.predictions = {key: list(map(_LAST8, hs)) for key, hs in rep.predictions.items()}

    def _store(self, rep: _Replica, lane: int, hashes: list[bytes]) -> None:
        held = rep.held[lane]
        bit = 1 << (lane * self.width + rep.slot)
        raw, packed, pack = self._raw, self._packed, self._pack
        for h in hashes:
            if h in held:
                continue
            held.add(h)
            v = raw.get(h, 0) | bit
            raw[h] = v
            packed[h] = pack(v)

    def _remove(self, rep: _Replica, lane: int, hashes: list[bytes]) -> None:
        held = rep.held[lane]
        keep = ~(1 << (lane * self.width + rep.slot))
        prov = rep.provisional if lane == 0 else {}  # a request in flight keeps its credit until it settles
        for h in hashes:
            if h in held:
                held.discard(h)
                if h not in prov:
                    self._drop_bit(h, keep)

    def _clear_lane(self, rep: _Replica, lane: int) -> None:
        keep = ~(1 << (lane * self.width + rep.slot))
        prov = rep.provisional if lane == 0 else {}
        for h in rep.held[lane]:
            if h not in prov:
                self._drop_bit(h, keep)
        rep.held[lane] = set()

    def _clear_replica(self, rep: _Replica) -> None:
        """Every block and every credit of ``rep`` dropped."""
        for lane in range(NUM_LANES):
            self._clear_lane(rep, lane)
        keep = ~(1 << rep.slot)
        for h in rep.provisional:
            self._drop_bit(h, keep)
        rep.provisional = {}
        rep.predictions = {}

    def _drop_bit(self, h: bytes, keep: int) -> None:
        v = self._raw[h] & keep
        if v:
            self._raw[h] = v
            self._packed[h] = self._pack(v)
        else:
            del self._raw[h]
            del self._packed[h]

    def _pack(self, raw: int) -> int:
        w, full = self.width, self._full
        g = raw & full
        c = g | ((raw >> w) & full)
        d = c | ((raw >> (2 * w)) & full)
        r = (raw >> (3 * w)) & full
        a = full if (r and self.shared_remote) else d | r
        return g | (c << w) | (d << (2 * w)) | (a << (3 * w))

    # -- lookups ----------------------------------------------------------------

    def lanes_of(self, block_hash: bytes) -> tuple[int, int, int, int]:
        """The four cumulative lanes of one hash, each a slot bitmask."""
        key = block_hash[-8:] if self.low64 else block_hash
        v, w, full = self._packed.get(key, 0), self.width, self._full
        return (v & full, (v >> w) & full, (v >> (2 * w)) & full, (v >> (3 * w)) & full)

    def lane_mask(self, slots_mask: int) -> int:
        """``slots_mask`` repeated in the four lanes (the walk's start)."""
        w = self.width
        return slots_mask | (slots_mask << w) | (slots_mask << (2 * w)) | (slots_mask << (3 * w))

    def prefix_blocks(self, hashes: list[bytes], live: int) -> dict[int, int]:
        """For the slots in ``live`` (a slot bitmask): bit ``lane * W + slot``
        -> the number of leading blocks of ``hashes`` that slot holds on that
        lane (or better). Bits absent from the result hit 0 blocks."""
        return self._runs(self._walk(hashes, self.lane_mask(live)))

    def prefix_blocks_lazy(self, chain: PromptChain, live: int) -> dict[int, int]:
        """:meth:`prefix_blocks` of a chain hashed on demand: the blocks it
        already knows are walked in C; past them, each next block is hashed
        only while some live replica still holds every block before it."""
        known = chain.start()
        n = len(known)
        acc = self._walk(known, self.lane_mask(live))
        if len(acc) == n + 1:  # no known block lost every replica: hash on
            get, low, extend = self._packed.get, self.low64, chain.extend_one
            v = acc[-1]
            while (h := extend()) is not None:
                v &= get(h[-8:] if low else h, 0)
                if not v:
                    break
                acc.append(v)
        return self._runs(acc)

    def _walk(self, hashes: list[bytes], start: int) -> list[int]:
        """The running AND along ``hashes`` from ``start`` while non-zero."""
        keys = map(_LAST8, hashes) if self.low64 else hashes
        return list(takewhile(bool, accumulate(map(self._packed.get, keys, repeat(0)), and_, initial=start)))

    @staticmethod
    def _runs(acc: list[int]) -> dict[int, int]:
        out: dict[int, int] = {}
        n, i = len(acc), 0
        while i < n:  # one step per distinct value: at most 4 * live replicas + 1
            v = acc[i]
            j = bisect_right(acc, -v, lo=i, key=neg)  # acc only decreases: end of v's run
            dropped = v & ~acc[j] if j < n else v
            while dropped:
                low = dropped & -dropped
                out[low.bit_length() - 1] = j - 1
                dropped ^= low
            i = j
        return out
