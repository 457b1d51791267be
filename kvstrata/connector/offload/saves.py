"""The offload connector's saves, on the scheduler side: which chunks each
step saves, into which L1 buffers, and putting the saved buffers into the
store once the worker reports them.

A request is tracked from its first lookup (``track``: the chunks before
``stored_until`` need no save) until it finishes. ``next_save`` is the first
chunk it may still have to save: chunks before it are in the store (found by
the lookup, or saved already) or were on the device when the request started
(their owner saved them).

    layer_saves(step)   chunks that fill up in this step's computed tokens
                        (prefill; decode too with ``save_decode``), gathered
                        after each layer
    preempted/finish    the unsaved chunks of the request's computed tokens,
                        queued as bulk saves for the next step (gathered
                        before the forward: the blocks may be reused then)

A save buffer is allocated from L1 when the step's metadata is built
(``StorageManager.allocate``: evicts as needed, None when it cannot: the save
is skipped and counted, it is a cache). A chunk some tier already holds is
not saved again. The blocks come from the KV cache manager's block tables
(``bind``), never from a copy.

Admission (``save_admission``; ``kvstrata.io.admission``). A save pays back
only if a later request reads the chunk; a one-off prompt's chunks never do,
and through a small L1 they evict the chunks that would. Each request, at its
first lookup, records its prompt's full chunks (and its partial chunk, with
``save_partial_chunks``) in a TinyLFU frequency sketch, once per request.
Then, before a chunk is given an L1 buffer:

    "all"       save it, into L1 and every lower tier (no sketch)
    "seen"      save it if at least ``min_seen`` requests asked for it
                (this one included), or if its request is a *continuation*
    "tinylfu"   while L1 has free room, save it (a copy into memory that
                evicts nothing); when the save would evict L1's next victim,
                only if the chunk's frequency reaches the victim's, except a
                continuation's chunks (the next turn reads them: recency
                wins, they evict like any LRU insert). Either way the
                lower tiers (disk, remote) get only the chunks that reach
                ``min_seen``: a chunk not yet seen twice lives in L1 only
                (``StorageManager.put(lower=False)``), so one-off traffic
                costs no disk writes and evicts nothing hot. With a tier
                shared by other engines (Redis, fs) no chunk is refused for
                an L1 victim: this engine's sketch cannot see their demand

The default, "tinylfu", keeps what saving everything gains when reuse is
high (a conversation's next turn finds the last turn in L1) and drops its
costs when it is low (lower-tier writes, L1 pollution).

A *continuation* is a request whose recurring prefix (the leading chunks
that reach ``min_seen``) covers at least ``admission_continuation`` of its
prompt's chunks: the next turn of a conversation (its history recurs, its
new message and reply are what the turn after it reads), not a one-off
prompt behind a short shared system prompt. Its chunks are saved, prompt
tail and reply alike (the finish save). Under "seen" the first turn of a
conversation looks like a one-off and is not saved: the second turn
recomputes what the device no longer holds, and saves; from the third turn
on the history hits. Under "tinylfu" the first turn is saved into L1 while
it has room.

A chunk not admitted is not saved (a miss later, recomputed), and neither is
any later chunk of the same request (a lookup stops at the first missing
chunk, so they could never be read). ``stats()`` counts the decisions.
"""

from __future__ import annotations

import math

import torch

from kvstrata.connector.base import BlockTables, ConnectorRequest
from kvstrata.connector.events import TierEventRecorder
from kvstrata.connector.metadata import ChunkTransfer, RequestTransfer
from kvstrata.connector.metrics import TransferMetrics
from kvstrata.connector.offload.chunks import ChunkGeometry
from kvstrata.connector.offload.lending import Lender, Lent
from kvstrata.connector.offload.options import OffloadOptions
from kvstrata.io import L1_SOURCE, ChunkKey, StorageManager
from kvstrata.io.admission import AdmissionPolicy
from kvstrata.types import SchedulerOutput

_Chunks = list[tuple[int, ChunkKey, int]]  # (chunk index, key, tokens)


class _Saving:
    """``inherit``: the frequency a continuation lends its chunks (0: none);
    ``gap``: a chunk of it was not admitted (none after it is saved)."""

    __slots__ = ("request", "next_save", "inherit", "gap")

    def __init__(self, request: ConnectorRequest, next_save: int, inherit: int = 0) -> None:
        self.request = request
        self.next_save = next_save
        self.inherit = inherit
        self.gap = False


class _Bulk:
    __slots__ = ("saving", "chunks", "block_ids", "finishing")

    def __init__(self, saving: _Saving, chunks: _Chunks, block_ids: list[int], finishing: bool) -> None:
        self.saving, self.chunks, self.block_ids, self.finishing = saving, chunks, block_ids, finishing


class SavePlanner:
    """Owns: each tracked request's save progress, the bulk saves queued for
    the next step, the finished requests whose blocks wait for the bulk
    saves of each step in flight (by step), the admission policy (its
    frequency sketch) and the admission counters. Loop only."""

    def __init__(self, store: StorageManager, geometry: ChunkGeometry, lender: Lender, metrics: TransferMetrics,
                 events: TierEventRecorder | None, *, num_layers: int, num_kv_heads: int, head_size: int,
                 dtype: torch.dtype, save_decode: bool, options: OffloadOptions | None = None) -> None:
        self.store = store
        self.geo = geometry
        self.lender = lender
        self.metrics = metrics
        self.events = events
        self.dtype = dtype
        self.dims = (num_layers, num_kv_heads, head_size)  # a chunk's buffer: (layers, 2, tokens, heads, head size)
        self.save_decode = save_decode
        self._tables: BlockTables | None = None
        self._saving: dict[str, _Saving] = {}
        self._bulk: list[_Bulk] = []
        self._step_finishing: dict[int, list[str]] = {}
        self._admitted = self._rejected = 0
        mode = options.save_admission if options is not None else "all"
        self._tinylfu = mode == "tinylfu"
        # With a tier shared by other engines, what is saved serves them too (this
        # engine's sketch cannot see their demand): no chunk is refused for an L1
        # victim; the local tiers are still kept for chunks seen twice.
        self._victims = self._tinylfu and not store.has_shared_tiers
        self._continuation = options.admission_continuation if options is not None else 1.0
        self._admission = self._policy(options) if options is not None and mode != "all" else None

    def _policy(self, options: OffloadOptions) -> AdmissionPolicy:
        capacity = options.admission_capacity
        if capacity is None:  # as many chunks as L1 holds, at least 1024
            layers, heads, size = self.dims
            chunk_bytes = layers * 2 * self.geo.chunk_size * heads * size * self.dtype.itemsize
            capacity = max(1024, self.store.config.cpu.capacity_bytes // chunk_bytes)
        return AdmissionPolicy(capacity, min_seen=options.admission_min_seen,
                               sample_factor=options.admission_sample_factor)

    def stats(self) -> dict[str, float]:
        """Admission decisions since the start (every save asked for is
        admitted under "all")."""
        return {"connector.save_admission_admitted": float(self._admitted),
                "connector.save_admission_rejected": float(self._rejected)}

    def bind(self, tables: BlockTables) -> None:
        self._tables = tables

    def tracked(self) -> list[str]:
        return list(self._saving)

    # -- per request -------------------------------------------------------------
    def track(self, request: ConnectorRequest, stored_until: int) -> None:
        """The request (re)starts: chunks before ``stored_until`` need no save."""
        s = self._saving.get(request.request_id)
        if s is None:
            inherit = self._observe(request) if self._admission is not None else 0
            self._saving[request.request_id] = _Saving(request, stored_until, inherit)
        else:
            s.next_save, s.gap = stored_until, False

    def _observe(self, request: ConnectorRequest) -> int:
        """Record the request's prompt chunks (once per request); returns the
        frequency its chunks inherit: ``min_seen`` for a continuation, else 0."""
        adm = self._admission
        assert adm is not None
        geo, bh = self.geo, request.block_hashes
        n_full = len(bh) // geo.bpc
        keys = [geo.key(bh, c, geo.chunk_size) for c in range(n_full)]
        for key in keys:
            adm.record(key)
        if self.store.config.save_partial_chunks and len(bh) % geo.bpc:
            adm.record(geo.key(bh, n_full, (len(bh) - n_full * geo.bpc) * geo.block_size))
        recurring = 0
        for key in keys:
            if adm.estimate(key) < adm.min_seen:
                break
            recurring += 1
        return adm.min_seen if recurring and recurring >= self._continuation * n_full else 0

    def rewind(self, req_id: str, chunk: int) -> None:
        """Chunks from ``chunk`` on were not loaded after all: the request saves them."""
        s = self._saving.get(req_id)
        if s is not None:
            s.next_save = min(s.next_save, chunk)
            s.gap = False

    def load_failed(self, req_id: str, invalid: set[int]) -> None:
        """A load into some of the request's blocks failed: it recomputes from
        the first of them, and saves again from that block's chunk."""
        s = self._saving.get(req_id)
        if s is None or self._tables is None:
            return
        for i, b in enumerate(self._tables.get_block_ids(req_id)[0]):
            if b in invalid:
                self.rewind(req_id, i // self.geo.bpc)
                return

    def preempted(self, request: ConnectorRequest, block_ids: list[int]) -> None:
        s = self._saving.get(request.request_id)
        if s is not None:
            self._queue_bulk(s, request.num_computed_tokens, block_ids, finishing=False)

    def finish(self, request: ConnectorRequest, block_ids: list[int] | None) -> bool:
        """Forget the request; with ``block_ids``, first queue its unsaved
        chunks. True: its blocks must wait for those saves."""
        s = self._saving.pop(request.request_id, None)
        if s is None or not block_ids:
            return False
        return self._queue_bulk(s, request.num_computed_tokens, block_ids, finishing=True)

    def _queue_bulk(self, s: _Saving, upto_tokens: int, block_ids: list[int], *, finishing: bool) -> bool:
        """Queue the unsaved chunks among the first ``upto_tokens``; False when there are none."""
        geo, bh = self.geo, s.request.block_hashes
        cs, bs, bpc = geo.chunk_size, geo.block_size, geo.bpc
        n_full = min(upto_tokens // cs, len(bh) // bpc)
        chunks = [(c, geo.key(bh, c, cs), cs) for c in range(s.next_save, n_full)]
        nb = min(upto_tokens // bs, len(bh))
        if self.store.config.save_partial_chunks and nb > n_full * bpc and n_full >= s.next_save:
            n = (nb - n_full * bpc) * bs  # the partial chunk: up to the last computed full block
            chunks.append((n_full, geo.key(bh, n_full, n), n))
        s.next_save = max(s.next_save, n_full)
        if not chunks:
            return False
        self._bulk.append(_Bulk(s, chunks, list(block_ids), finishing))
        return True

    # -- the step ------------------------------------------------------------------
    def take_bulk(self, step: int) -> tuple[list[RequestTransfer], list[str]]:
        """The queued bulk saves, lent buffers and all, for step ``step``, and
        the finished requests whose blocks wait for them."""
        bulk, self._bulk = self._bulk, []
        out = [rt for b in bulk if (rt := self._lend(b.saving, b.chunks, b.block_ids))]
        finishing = [b.saving.request.request_id for b in bulk if b.finishing]
        if finishing:
            self._step_finishing[step] = finishing
        return out, list(finishing)

    def layer_saves(self, so: SchedulerOutput) -> list[RequestTransfer]:
        """Chunks that fill up in this step's computed tokens."""
        out: list[RequestTransfer] = []
        sched_n = so.num_scheduled_tokens
        for data in so.scheduled_new_reqs:
            self._fills(data.req_id, data.num_computed_tokens, sched_n[data.req_id], out)
        cached = so.scheduled_cached_reqs
        for rid, nc in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self._fills(rid, nc, sched_n[rid], out)
        return out

    def _fills(self, rid: str, nc: int, n: int, out: list[RequestTransfer]) -> None:
        s = self._saving.get(rid)
        if s is None:
            return
        geo = self.geo
        c_end = (nc + n) // geo.chunk_size
        if c_end <= s.next_save:
            return
        req = s.request
        if nc >= req.num_prompt_tokens and not self.save_decode:
            return  # decode: saved when the request finishes or is preempted
        if self._tables is None:
            raise RuntimeError("bind_block_tables() must be called before the first step")
        bh = req.block_hashes
        # With async scheduling a step computes the token the step before it is
        # still sampling: the chunk holding it has no key yet. It is saved by a
        # later step (its blocks are written by then) or when the request ends.
        c_end = min(c_end, len(bh) // geo.bpc)
        chunks = [(c, geo.key(bh, c, geo.chunk_size), geo.chunk_size) for c in range(s.next_save, c_end)]
        s.next_save = max(s.next_save, c_end)
        rt = self._lend(s, chunks, self._tables.get_block_ids(rid)[0])
        if rt is not None:
            out.append(rt)

    def _lend(self, s: _Saving, chunks: _Chunks, block_ids: list[int]) -> RequestTransfer | None:
        req = s.request
        transfers = []
        layers, heads, size = self.dims
        for c, key, n in chunks:
            if self.store.holds(key):
                self.metrics.count("skipped_saves")
                continue
            blocks = self.geo.blocks(block_ids, c, n)
            if len(blocks) * self.geo.block_size < n:
                continue  # the request no longer holds these blocks
            shape = (layers, 2, n, heads, size)
            decision = self._admit(s, key, shape)
            if decision is None:
                continue
            obj = self.store.allocate(shape, self.dtype, "kv")
            if obj is None:
                self.metrics.count("dropped_saves")
                continue
            info = self.geo.info(req, c, n) if self.events is not None else None
            handle = self.lender.lend(Lent(obj, key, req.request_id, info, lower=decision))
            transfers.append(ChunkTransfer(handle, blocks, 0, n))
        return RequestTransfer(req.request_id, transfers) if transfers else None

    def _admit(self, s: _Saving, key: ChunkKey, shape: tuple[int, ...]) -> bool | None:
        """Save ``key``? None: no; else whether the local lower tiers get it too."""
        decision = self._decide(s, key, shape)
        if decision is None:
            self._rejected += 1
        else:
            self._admitted += 1
        return decision

    def _decide(self, s: _Saving, key: ChunkKey, shape: tuple[int, ...]) -> bool | None:
        adm = self._admission
        if adm is None:
            return True
        if s.gap:
            return None
        victim = None
        if self._tinylfu:
            # A continuation's chunks are what its conversation's next turn reads:
            # recency wins there, they take L1's next victim like any LRU insert.
            if self._victims and not s.inherit:
                victim = self.store.l1_victim(math.prod(shape) * self.dtype.itemsize)
            if victim is None:  # room (or shared tiers): the local lower tiers wait for proof
                return max(adm.estimate(key), s.inherit) >= adm.min_seen
        if not adm.admit(key, victim, inherited=s.inherit):
            s.gap = True
            return None
        return True

    def put(self, saved: list[Lent]) -> None:
        """Put the buffers the worker saved into the store."""
        events = self.events
        l1 = self.store.source_name(L1_SOURCE)
        for entry in saved:
            key = entry.key
            if events is not None and entry.info is not None:
                events.describe(key, entry.info)
            self.store.put(key, entry.obj, lower=entry.lower)
            entry.obj.release()
            self.metrics.count("saved_chunks")
            if events is not None:
                if self.store.in_l1(key):
                    events.stored(key, l1)
                else:
                    events.forget(key)

    def step_done(self, step: int) -> None:
        """Step ``step`` came back (steps come back in order: so did those before it)."""
        for s in [s for s in self._step_finishing if s <= step]:
            del self._step_finishing[s]

    def step_failed(self, step: int | None) -> list[str]:
        """The finished requests whose saves were in the failed step ``step``
        (their blocks may be freed)."""
        return self._step_finishing.pop(step, []) if step is not None else []

    def has_pending(self) -> bool:
        return bool(self._bulk)

    def close(self) -> None:
        self._bulk = []
        self._saving.clear()
