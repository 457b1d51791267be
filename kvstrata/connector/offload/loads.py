"""The offload connector's loads, on the scheduler side: finding a request's
chunks and holding them until the worker copies them in.

Lookup, per waiting request (``match``, the scheduler's
``get_num_new_matched_tokens``): keys for the chunks from the first one the
device prefix hit does not fully cover; ``StorageManager.probe`` them; if
only I/O can tell, start a lookup (``locate``) and answer None. With
``save_partial_chunks``, the chunk after the last full one found may match a
shorter partial chunk (the tail a finished request saved). Then:

* every chunk ready in L1  -> take references, load within the step, layer by
  layer (``load_async`` False);
* chunks on local disk     -> ("auto", "sync") pin, promote them into L1 while
  answering None (the request holds no blocks meanwhile), then load within
  the step as above;
* chunks on a remote tier  -> ("auto", "async"; "async" for every tier) pin,
  answer ``load_async``; once blocks are allocated, fetch (promoting into
  L1) and hand the chunks to the worker as a bulk load before the forward;
  the request waits in WAITING_FOR_REMOTE_KVS until the worker reports it.

Load or compute (``costs.choose_split``, option ``load_split``): when some
chunks must be read from a lower tier, the first ``k`` chunks may be
recomputed while the fetch reads the others into L1. The request is then
admitted with no external tokens and a ``load_point`` at the first fetched
chunk; when its computed tokens reach it, ``match`` answers the fetched
chunks (loaded within the step, layer by layer). If the fetch has not
landed by then, the request computes one more chunk and asks again (the
compute and the load meet where both are done); once nothing would be left
to load, the fetch is dropped.

``prefetch`` starts the lookup or promotion when a request arrives, so it is
usually done by the time the scheduler reaches the request. A task that ends
(a lookup answered, a fetch landed) wakes the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Coroutine
from typing import Any, NamedTuple, TypeVar

import structlog

from kvstrata.connector.base import ConnectorRequest
from kvstrata.connector.events import TierEventRecorder
from kvstrata.connector.metadata import ChunkTransfer, RequestTransfer
from kvstrata.connector.metrics import TransferMetrics
from kvstrata.connector.offload.chunks import ChunkGeometry
from kvstrata.connector.offload.costs import ChunkCost, Split, choose_split, forced_split
from kvstrata.connector.offload.lending import Lender, Lent
from kvstrata.connector.offload.options import OffloadOptions
from kvstrata.connector.offload.tracker import LoadPlan, LoadTracker
from kvstrata.connector.wakeup import Wakeup
from kvstrata.io import L1_SOURCE, ChunkKey, ChunkKeyer, MemoryObj, Pin, StorageManager
from kvstrata.io.memory import release_all

log = structlog.get_logger(__name__)
_T = TypeVar("_T")


class Match(NamedTuple):
    """The answer for one waiting request: ``tokens`` to load (None: not
    known yet), whether asynchronously, and ``stored_until``: the chunks
    before it are in the store or on the device (the request need not save them)."""

    tokens: int | None
    load_async: bool = False
    stored_until: int = 0


class Handover(NamedTuple):
    """One request's chunks handed to the worker; ``resave_from``: the first
    chunk the store did not deliver (the request must save it and those
    after it itself), or None."""

    transfer: RequestTransfer
    resave_from: int | None


class LoadPlanner:
    """Owns: each request's load (a LoadTracker, from its first lookup until
    it finishes), the requests prefetched and not yet asked for, the tasks
    it started, and the bulk loads of each step in flight, by step (their
    requests are retried if the step fails). Loop only."""

    def __init__(self, store: StorageManager, geometry: ChunkGeometry, keyer: ChunkKeyer, opts: OffloadOptions,
                 lender: Lender, metrics: TransferMetrics, events: TierEventRecorder | None, wakeup: Wakeup,
                 *, bytes_per_token: int = 0) -> None:
        self.store = store
        self.bytes_per_token = bytes_per_token  # a chunk's bytes per token, for the read-time estimate
        self.geo = geometry
        self.keyer = keyer
        self.opts = opts
        self.lender = lender
        self.metrics = metrics
        self.events = events
        self.wakeup = wakeup
        self._loads: dict[str, LoadTracker] = {}
        self._prefetched: set[str] = set()
        self._tasks: set[asyncio.Task[object]] = set()  # lookups (-> sources found) and fetches (-> None)
        # step -> (request, the blocks it recomputes if the step fails), per bulk load
        self._step_bulk: dict[int, list[tuple[str, list[int]]]] = {}

    def tracked(self) -> list[str]:
        return list(self._loads)

    def _track(self, request: ConnectorRequest) -> LoadTracker:
        t = self._loads.get(request.request_id)
        if t is None:
            t = self._loads[request.request_id] = LoadTracker(request)
        return t

    # -- lookup ------------------------------------------------------------------
    def prefetch(self, request: ConnectorRequest) -> None:
        """A request just arrived: if its chunks need a lookup or a promotion
        from disk, start them now, so they are in CPU memory by the time the
        scheduler reaches it. At most ``max_prefetch`` requests at a time."""
        if len(self._prefetched) >= self.opts.max_prefetch:
            return
        keys = self.keyer.keys(request.block_hashes)
        srcs, definite = self.store.probe(keys)
        if not keys or (definite and all(s == L1_SOURCE for s in srcs)):
            return  # nothing stored, or all of it ready: the scheduler's own lookup is as fast
        t = self._track(request)
        if t.plan is None:
            self._prefetched.add(request.request_id)
            # No split yet: the device hit, which decides where computing starts, is not known.
            self._make_plan(t, 0, split=False)

    def match(self, request: ConnectorRequest, num_computed_tokens: int) -> Match:
        t = self._track(request)
        self._prefetched.discard(t.req_id)
        cs = self.geo.chunk_size
        start = num_computed_tokens // cs
        if t.split_at is None and t.fetch is not None and not t.fetch.done() and t.plan is not None \
                and not t.plan.is_async and t.plan.start <= start:
            # A prefetch's promotion in flight: maybe compute the front meanwhile.
            answer = self._split_promotion(t, start)
            if answer is not None:
                return answer
        if t.split_at is not None:
            assert t.plan is not None and t.fetch is not None
            if start < t.split_at:  # still computing the front
                return Match(0, False, self._stored_until(t.plan))
            if not t.fetch.done():
                return Match(None)  # not landed: the scheduler asks load_point
            t.split_at = None  # landed: the rest loads from where the computing got to
        if t.plan is None or t.lookup is not None or (t.fetch is not None and not t.plan.is_async):
            if not self._make_plan(t, t.plan.start if t.plan is not None else start):
                return Match(None)
        if t.split_at is None and t.plan is not None and t.plan.start != start and not self._rebase(t, start):
            if not self._make_plan(t, start):
                return Match(None)
        plan = t.plan
        assert plan is not None
        stored_until = self._stored_until(plan)
        if t.split_at is not None:  # just decided: compute up to it first
            return Match(0, False, stored_until)
        ext = min(plan.token_end, request.num_tokens - 1) - num_computed_tokens
        t.load_skip = num_computed_tokens - start * cs
        t.query_tokens = max(0, request.num_tokens - 1 - num_computed_tokens)
        if ext <= 0:
            t.drop_plan(self.store)
            return Match(0, False, stored_until)
        return Match(ext, plan.is_async, stored_until)

    def _stored_until(self, plan: LoadPlan) -> int:
        """The chunk up to which the plan's chunks and those before it are stored."""
        return plan.start + sum(1 for k in plan.keys if k.num_tokens == self.geo.chunk_size)

    def load_point(self, request: ConnectorRequest) -> int | None:
        """Where ``request`` (computing the front of a split hit) asks again:
        the first fetched chunk; if its computed tokens are there and the
        fetch has not landed, where they are (wait) when the fetch is due
        sooner than computing one more chunk would take, else one chunk
        further; None: no split (any more)."""
        t = self._loads.get(request.request_id)
        if t is None or t.split_at is None or t.plan is None:
            return None
        cs, plan = self.geo.chunk_size, t.plan
        nc = request.num_computed_tokens
        if nc < t.split_at * cs:
            return t.split_at * cs
        remaining = None if t.fetch_eta is None else t.fetch_eta - time.perf_counter()
        s_tok = self.metrics.s_per_token
        if remaining is not None and remaining > 0 and s_tok is not None \
                and remaining < self.metrics.step_s + cs * s_tok:
            return nc  # due sooner than one more chunk would take: wait for it
        nxt = (nc // cs + 1) * cs
        if nxt >= min(plan.token_end, request.num_tokens - 1):
            self.metrics.count("split_fetch_outrun")  # computing got past the hit first
            t.drop_plan(self.store)
            return None
        return nxt

    def _rebase(self, t: LoadTracker, start: int) -> bool:
        """Fit a settled plan made from an earlier chunk (a prefetch, before the
        device hit was known) to start at ``start``; False: plan afresh."""
        plan = t.plan
        assert plan is not None
        drop = start - plan.start
        if (drop < 0 or drop >= len(plan.keys) or plan.is_async
                or plan.keys[drop - 1].num_tokens != self.geo.chunk_size):
            t.drop_plan(self.store)
            return False
        release_all(plan.objs[:drop])
        plan.objs, plan.keys, plan.srcs = plan.objs[drop:], plan.keys[drop:], plan.srcs[drop:]
        plan.start = start
        return True

    def _make_plan(self, t: LoadTracker, start: int, *, split: bool = True) -> bool:
        """Advance ``t``'s plan; False while a lookup or a promotion is in flight."""
        if t.plan is None:
            self.metrics.count("lookups")
            keys = self.keyer.keys(t.request.block_hashes, start_chunk=start)
            srcs, definite = self.store.probe(keys)
            if definite and len(srcs) < len(keys) and self.store.config.save_partial_chunks:
                part = self._probe_partial(t.request, start + len(srcs), keys[len(srcs)])
                if part is not None:
                    keys, srcs = [*keys[:len(srcs)], part[0]], [*srcs, part[1]]
            t.plan = LoadPlan(start, keys, srcs, 0)
            if not definite:
                t.lookup = self.spawn(_within(self.store.locate(keys[len(srcs):]), self.opts.lookup_timeout_s,
                                               [], "store_lookup_timeout"))
                return False
        plan, cs = t.plan, self.geo.chunk_size
        if t.lookup is not None:
            if not t.lookup.done():
                return False
            found = _result(t.lookup, [])
            t.lookup = None
            plan.srcs += found[:len(plan.keys) - len(plan.srcs)]
        if t.fetch is not None:  # "sync" mode: a promotion of lower-tier chunks into L1
            if not t.fetch.done():
                return False
            t.fetch = None
            plan.objs, t.fetched = t.fetched or [], None
            lost = plan.keys[len(plan.objs):]
            if lost:  # found by the lookup, then unreadable: recomputed
                self.metrics.count("load_failed_tokens", sum(k.num_tokens for k in lost))
            plan.cut(len(plan.objs), cs)
            return True
        plan.cut(len(plan.srcs), cs)
        self.metrics.count("lookup_hit_chunks", len(plan.keys))
        if not plan.keys:
            return True
        return self._hold(t, plan, split=split)

    def _probe_partial(self, request: ConnectorRequest, c: int, missing: ChunkKey) -> tuple[ChunkKey, int] | None:
        """The longest partial chunk ``c`` that L1 or a local tier holds (a
        finished or preempted request saved it: the tail of a conversation
        turn), shorter than ``missing``; None if there is none."""
        bs = self.geo.block_size
        first = c * self.geo.bpc
        last = min(len(request.block_hashes), first + self.geo.bpc) - 1
        for j in range(last, first - 1, -1):
            key = self.geo.key(request.block_hashes, c, (j - first + 1) * bs)
            if key == missing or key.num_tokens >= missing.num_tokens:
                continue
            srcs, _ = self.store.probe([key])
            if srcs:
                return key, srcs[0]
        return None

    def _hold(self, t: LoadTracker, plan: LoadPlan, *, split: bool) -> bool:
        """Keep the found chunks from eviction: references to chunks ready in
        L1, else pins, and start the promotion a synchronous load needs (or,
        for a split, the fetch of the chunks after the computed front)."""
        mode = self.opts.load_mode
        if mode != "async" and all(s == L1_SOURCE for s in plan.srcs):
            plan.objs = self.store.take_ready(plan.keys)
            plan.cut(len(plan.objs), self.geo.chunk_size)
            return True
        if split:
            decision = self._split(plan)
            k = decision.compute
            if k >= len(plan.keys):
                self.metrics.count("split_compute_only")
                plan.cut(0, self.geo.chunk_size)
                return True
            if k > 0:
                self.metrics.count("split_loads")
                keys, srcs = plan.keys[k:], plan.srcs[k:]
                pins = self.store.pin(keys, srcs)
                plan.start, plan.keys, plan.srcs = plan.start + k, keys, srcs
                t.split_at = plan.start
                t.fetch = self.spawn(self._fetch(t, list(keys), pins))
                if decision.load_s is not None:
                    t.fetch_eta = time.perf_counter() + decision.load_s
                return True
            self.metrics.count("split_load_only")
        pins = self.store.pin(plan.keys, plan.srcs)
        if mode == "sync" or (mode == "auto" and all(self.store.is_local(s) for s in plan.srcs)):
            t.fetch = self.spawn(self._fetch(t, list(plan.keys), pins))
            if split:
                t.split_at = plan.start  # decided: load it all (no second decision while it reads)
            return False
        plan.pins = pins
        plan.is_async = True
        return True

    def _split_promotion(self, t: LoadTracker, start: int) -> Match | None:
        """The plan's chunks are being promoted (a prefetch started it) and
        the request computes from chunk ``start``: decide the split there,
        once; the promotion is the fetch (the chunks computed meanwhile are
        dropped when it lands). Returns the answer when the whole hit is
        recomputed, else None (``t.split_at`` set: ``start`` to wait for it all)."""
        plan = t.plan
        assert plan is not None
        skip = start - plan.start
        if skip >= len(plan.keys):
            return None
        stored_until = self._stored_until(plan)
        k = self._split(LoadPlan(start, plan.keys[skip:], plan.srcs[skip:], plan.token_end)).compute
        if k >= len(plan.keys) - skip:
            self.metrics.count("split_compute_only")
            t.drop_plan(self.store)
            t.plan = LoadPlan(start, [], [], start * self.geo.chunk_size)
            return Match(0, False, stored_until)
        self.metrics.count("split_loads" if k else "split_load_only")
        t.split_at = start + k
        return None

    def _split(self, plan: LoadPlan) -> Split:
        """How many of the plan's leading chunks to compute rather than load."""
        opts, n = self.opts, len(plan.keys)
        if opts.load_split_fraction is not None:
            return forced_split(n, opts.load_split_fraction)
        if opts.load_split == "load":
            return Split(0, None, "load")
        if opts.load_split == "compute":
            return Split(n, None, "compute")
        rates = self.store.read_rates()
        names = [None if s == L1_SOURCE else self.store.source_name(s) for s in plan.srcs]
        chunks = [ChunkCost(k.num_tokens, k.num_tokens * self.bytes_per_token, name)
                  for k, name in zip(plan.keys, names, strict=True)]
        return choose_split(chunks, self.metrics.s_per_token,
                            lambda tier, nbytes: rates[tier].predict(nbytes),
                            lambda tier: rates[tier].failure_rate, self.metrics.step_s)

    async def _fetch(self, t: LoadTracker, keys: list[ChunkKey], pins: list[Pin]) -> None:
        """The leading chunks, promoted into L1 and referenced, into
        ``t.fetched`` (fewer or none when a tier fails or the load times out);
        the pins go once the references are held."""
        t0 = time.perf_counter()
        try:
            objs = await _within(self.store.get(keys), self.opts.load_timeout_s, [], "store_fetch_timeout")
        finally:
            self.store.release_pins(pins)
        if t.fetch is not asyncio.current_task():
            release_all(objs)  # the request went away (or re-planned) meanwhile
            return
        t.fetched = objs
        t.load_s += time.perf_counter() - t0  # the I/O wait counts as load time
        if self.events is not None:
            l1 = self.store.source_name(L1_SOURCE)
            for key in keys[:len(objs)]:
                self._describe(t, key)
                if self.store.in_l1(key):
                    self.events.stored(key, l1)

    def _describe(self, t: LoadTracker, key: ChunkKey) -> None:
        if self.events is not None and t.plan is not None and key in t.plan.keys:
            c = t.plan.start + t.plan.keys.index(key)
            self.events.describe(key, self.geo.info(t.request, c, key.num_tokens))

    # -- allocation and handover ---------------------------------------------------
    def allocated(self, request: ConnectorRequest, block_ids: tuple[list[int], ...], num_external_tokens: int) -> None:
        t = self._loads.get(request.request_id)
        if t is None:
            return
        plan = t.plan
        if plan is None or num_external_tokens <= 0:
            if t.split_at is None:  # a split keeps its fetch while the front is computed
                t.drop_plan(self.store)
            return
        cs, geo = self.geo.chunk_size, self.geo
        t.load_limit = t.load_skip + num_external_tokens
        needed = -(-t.load_limit // cs)
        t.load_blocks = list(block_ids[0][plan.start * geo.bpc: geo.num_blocks(plan.start * cs + t.load_limit)])
        t.hit_tokens = num_external_tokens
        t.hit_tier = self._attribute(plan, t.load_skip, t.load_limit)
        if plan.is_async:
            pins, plan.pins = plan.pins, []
            t.handover = "bulk"
            t.fetch = self.spawn(self._fetch(t, plan.keys[:needed], pins))
            self.metrics.count("async_loads")
        else:
            release_all(plan.objs[needed:])
            plan.objs, plan.keys = plan.objs[:needed], plan.keys[:needed]
            t.handover = "layer"
            self.metrics.count("sync_loads")

    def _attribute(self, plan: LoadPlan, skip: int, limit: int) -> dict[str, int]:
        """Hit tokens per tier: the part of each chunk inside ``[skip, limit)``."""
        by_tier: dict[str, int] = {}
        pos = 0
        for key, src in zip(plan.keys, plan.srcs, strict=True):
            lo, hi = max(pos, skip), min(pos + key.num_tokens, limit)
            if hi > lo:
                name = self.store.source_name(src)
                by_tier[name] = by_tier.get(name, 0) + hi - lo
            pos += key.num_tokens
        return by_tier

    def hand_over(self, step: int) -> tuple[list[Handover], list[Handover]]:
        """Step ``step``'s loads: (within the step, layer by layer: the sync
        loads allocated since the last step; before the forward: the async
        loads whose fetch landed)."""
        loads = list(self._loads.values())
        layer = [self._lend(t, t.plan.objs if t.plan else []) for t in loads if t.handover == "layer"]
        landed = [t for t in loads if t.handover == "bulk" and t.fetch is not None and t.fetch.done()]
        bulk = []
        bs = self.geo.block_size
        for t in landed:
            t.fetch = None
            self._step_bulk.setdefault(step, []).append((t.req_id, t.load_blocks[t.load_skip // bs:]))
            bulk.append(self._lend(t, t.fetched or []))
        return layer, bulk

    def _lend(self, t: LoadTracker, objs: list[MemoryObj]) -> Handover:
        """Lend ``objs`` (the plan's leading chunks, references owned from now
        on by the lender) to the worker; blocks of chunks not delivered are
        reported failed, so the scheduler recomputes them."""
        plan, bs = t.plan, self.geo.block_size
        keys = plan.keys if plan is not None else []
        if plan is not None:
            plan.objs = []
        t.fetched = None
        skip, limit, blocks = t.load_skip, t.load_limit, t.load_blocks
        transfers, pos = [], 0
        for key, obj in zip(keys, objs, strict=False):  # objs: the leading chunks delivered
            lo, hi = max(0, skip - pos), min(key.num_tokens, limit - pos)
            handle = self.lender.lend(Lent(obj, key, t.req_id))
            if hi > lo:
                transfers.append(ChunkTransfer(handle, blocks[pos // bs: -(-(pos + hi) // bs)], lo, hi))
            pos += key.num_tokens
        release_all(objs[len(keys):])
        failed: list[int] = []
        resave_from = None
        if pos < limit:
            first_bad = max(pos, skip)
            failed = blocks[first_bad // bs:]
            self.metrics.count("load_failed_tokens", limit - first_bad)
            if plan is not None:
                t.hit_tier = self._attribute(plan, skip, first_bad)
                t.hit_tokens = max(0, first_bad - skip)
                resave_from = plan.start + len(objs)
        self.metrics.count("load_chunks", len(transfers))
        t.drop_plan(self.store)
        return Handover(RequestTransfer(t.req_id, transfers, failed), resave_from)

    # -- the step and the request's end ------------------------------------------------
    def add_load_time(self, req_id: str, seconds: float) -> None:
        t = self._loads.get(req_id)
        if t is not None:
            t.load_s += seconds

    def step_done(self, step: int) -> None:
        """Step ``step`` came back (steps come back in order: so did those before it)."""
        for s in [s for s in self._step_bulk if s <= step]:
            del self._step_bulk[s]

    def step_failed(self, step: int | None) -> tuple[list[str], list[int]]:
        """Step ``step`` failed: the requests whose bulk load it did not make,
        and their blocks (to recompute)."""
        loads = self._step_bulk.pop(step, []) if step is not None else []
        return [rid for rid, _ in loads], [b for _, blocks in loads for b in blocks]

    def preempted(self, req_id: str) -> None:
        t = self._loads.get(req_id)
        if t is not None:
            t.drop_plan(self.store)

    def finish(self, req_id: str) -> LoadTracker | None:
        """Forget the request; returns its load (for the books), None if it had none."""
        self._prefetched.discard(req_id)
        t = self._loads.pop(req_id, None)
        if t is not None:
            t.drop_plan(self.store)
        return t

    def has_pending(self) -> bool:
        return bool(self._tasks) or any(t.handover == "layer" for t in self._loads.values())

    def spawn(self, coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:  # Any: as asyncio's create_task
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[object]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            self.wakeup()  # a lookup answered or a load landed: the engine can go on

    async def aclose(self) -> None:
        for t in self._loads.values():
            t.drop_plan(self.store)
        self._loads.clear()
        self._prefetched.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


async def _within(aw: Awaitable[_T], timeout_s: float, default: _T, event: str) -> _T:
    """``aw``'s result, or ``default`` (logged as ``event``) after ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            return await aw
    except TimeoutError:
        log.warning(event, timeout_s=timeout_s)
        return default


def _result(task: asyncio.Task[_T], default: _T) -> _T:
    return default if task.cancelled() or task.exception() is not None else task.result()
