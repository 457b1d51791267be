"""The offload connector's loads, on the scheduler side: finding a request's
chunks and holding them until the worker copies them in.

Lookup, per waiting request (``match``, the scheduler's
``get_num_new_matched_tokens``): keys for the chunks from the first one the
device prefix hit does not fully cover; ``probe`` them; if only I/O can tell,
start a lookup and answer None. With ``save_partial_chunks``, the chunk after
the last full one found may match a shorter partial chunk (the tail a
finished request saved). Then:

* every chunk ready in L1  -> take references, load within the step, layer by
  layer (``load_async`` False);
* chunks on local disk     -> ("auto", "sync") pin, promote them into L1 while
  answering None (the request holds no blocks meanwhile), then load within
  the step as above;
* chunks on a remote tier  -> ("auto", "async"; "async" for every tier) pin,
  answer ``load_async``; once blocks are allocated, fetch (promoting into
  L1) and hand the chunks to the worker as a bulk load before the forward;
  the request waits in WAITING_FOR_REMOTE_KVS until the worker reports it.

``prefetch`` starts the lookup or promotion when a request arrives, so it is
usually done by the time the scheduler reaches the request.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from kvstrata.io import ChunkKey
from kvstrata.io.memory import release_all
from kvstrata.connector.offload import lookup as L
from kvstrata.connector.offload.tracker import LoadPlan, RequestTracker

if TYPE_CHECKING:
    from kvstrata.connector.offload.scheduler import OffloadScheduler


class LoadPlanner:
    """Owns nothing of its own: the logic of the scheduler side's load plans
    (the state lives in the scheduler's trackers). Loop only."""

    def __init__(self, sched: OffloadScheduler) -> None:
        self.s = sched

    def match(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        t = self.s.trackers.get(rid)
        if t is None:
            t = self.s.trackers[rid] = RequestTracker(request)
        self.s.prefetched.discard(rid)
        start = num_computed_tokens // self.s.chunk_size
        if not self.s.loads:
            t.next_save = start
            return 0, False
        if t.plan is None or t.lookup is not None or (t.fetch is not None and not t.plan.is_async):
            if not self._make_plan(t, request, t.plan.start if t.plan is not None else start):
                return None, False
        if t.plan.start != start and not self._rebase(t, start):
            if not self._make_plan(t, request, start):
                return None, False
        plan = t.plan
        assert plan is not None
        t.next_save = start + sum(1 for k in plan.keys if k.num_tokens == self.s.chunk_size)
        ext = min(plan.token_end, request.num_tokens - 1) - num_computed_tokens
        t.load_skip = num_computed_tokens - start * self.s.chunk_size
        if ext <= 0:
            t.drop_plan()
            return 0, False
        return ext, plan.is_async

    def prefetch(self, request: Any) -> None:
        """A request just arrived: if its chunks need a lookup or a promotion
        from disk, start them now, so they are in CPU memory by the time the
        scheduler reaches it. At most ``max_prefetch`` requests at a time."""
        if not self.s.loads or len(self.s.prefetched) >= self.s.opts.max_prefetch:
            return
        keys = self.s.keyer.keys(request.block_hashes)
        srcs, definite = L.probe(self.s.store, keys)
        if not keys or (definite and (not srcs or L.all_ready_in_l1(self.s.store, srcs))):
            return  # nothing stored, or all of it ready: the scheduler's own lookup is as fast
        t = self.s.trackers.get(request.request_id)
        if t is None:
            t = self.s.trackers[request.request_id] = RequestTracker(request)
        if t.plan is None:
            self.s.prefetched.add(request.request_id)
            self._make_plan(t, request, 0)

    def _rebase(self, t: RequestTracker, start: int) -> bool:
        """Fit a settled plan made from an earlier chunk (a prefetch, before the
        device hit was known) to start at ``start``; False: plan afresh."""
        plan = t.plan
        drop = start - plan.start
        if drop < 0 or drop >= len(plan.keys) or plan.is_async or plan.keys[drop - 1].num_tokens != self.s.chunk_size:
            t.drop_plan()
            return False
        release_all(plan.objs[:drop])
        plan.objs, plan.keys, plan.srcs = plan.objs[drop:], plan.keys[drop:], plan.srcs[drop:]
        plan.start = start
        return True

    def _make_plan(self, t: RequestTracker, request: Any, start: int) -> bool:
        """Advance ``t``'s plan; False while a lookup or a promotion is in flight."""
        if t.plan is None:
            self.s.metrics.count("lookups")
            keys = self.s.keyer.keys(request.block_hashes, start_chunk=start)
            srcs, definite = L.probe(self.s.store, keys)
            if definite and len(srcs) < len(keys) and self.s.store.config.save_partial_chunks:
                part = L.probe_partial(self.s.store, self.s.fingerprint, request.block_hashes, start + len(srcs),
                                       self.s.bpc, self.s.spec.block_size, keys[len(srcs)])
                if part is not None:
                    keys = [*keys[:len(srcs)], part[0]]
                    srcs = [*srcs, part[1]]
            t.plan = LoadPlan(start, keys, srcs, 0)
            if not definite:
                t.lookup = self.s.spawn(L.lookup(self.s.store, keys[len(srcs):], self.s.opts.lookup_timeout_s))
                return False
        plan = t.plan
        if t.lookup is not None:
            if not t.lookup.done():
                return False
            found = _result(t.lookup, 0)
            t.lookup = None
            extra = plan.keys[len(plan.srcs):len(plan.srcs) + found]
            plan.srcs += [L.guess_source(self.s.store, k) for k in extra]
        if t.fetch is not None:  # "sync" mode: a promotion of lower-tier chunks into L1
            if not t.fetch.done():
                return False
            t.fetch = None
            plan.objs, t.fetched = t.fetched or [], None
            lost = plan.keys[len(plan.objs):]
            if lost:  # found by the lookup, then unreadable: recomputed
                self.s.metrics.count("load_failed_tokens", sum(k.num_tokens for k in lost))
            plan.keys = plan.keys[:len(plan.objs)]
            plan.srcs = plan.srcs[:len(plan.objs)]
            plan.token_end = plan.start * self.s.chunk_size + sum(k.num_tokens for k in plan.keys)
            return True
        plan.keys = plan.keys[:len(plan.srcs)]
        plan.token_end = plan.start * self.s.chunk_size + sum(k.num_tokens for k in plan.keys)
        self.s.metrics.count("lookup_hit_chunks", len(plan.keys))
        if not plan.keys:
            return True
        return self._hold(t, plan)

    def _hold(self, t: RequestTracker, plan: LoadPlan) -> bool:
        mode = self.s.opts.load_mode
        if mode != "async" and L.all_ready_in_l1(self.s.store, plan.srcs):
            plan.objs = L.take_l1(self.s.store, plan.keys)
            n = len(plan.objs)
            plan.keys, plan.srcs = plan.keys[:n], plan.srcs[:n]
            plan.token_end = plan.start * self.s.chunk_size + sum(k.num_tokens for k in plan.keys)
            return True
        pins = L.pin_chunks(self.s.store, plan.keys, plan.srcs)
        if mode == "sync" or (mode == "auto" and L.all_local(self.s.store, plan.srcs)):
            t.fetch = self.s.spawn(self._fetch(t, list(plan.keys), pins))
            return False
        plan.pins = pins
        plan.is_async = True
        return True

    async def _fetch(self, t: RequestTracker, keys: list[ChunkKey], pins: list) -> None:
        t0 = time.perf_counter()
        objs = await L.fetch(self.s.store, keys, self.s.opts.load_timeout_s, pins)
        if t.finished or t.fetch is not asyncio.current_task():
            release_all(objs)  # the request went away (or re-planned) meanwhile
            return
        t.fetched = objs
        t.load_s += time.perf_counter() - t0  # the I/O wait counts as load time
        if self.s.events is not None:
            for key in keys[:len(objs)]:
                self._describe_loaded(t, key)
                if self.s.store.l1.contains(key):
                    self.s.events.stored(key, self.s.store.l1.name)

    def allocated(self, request: Any, block_ids: tuple[list[int], ...], num_external_tokens: int) -> None:
        t = self.s.trackers.get(request.request_id)
        if t is None:
            return
        plan = t.plan
        if plan is None or num_external_tokens <= 0:
            t.drop_plan()
            return
        cs, bs = self.s.chunk_size, self.s.spec.block_size
        first = plan.start * cs
        t.load_limit = t.load_skip + num_external_tokens
        needed = -(-t.load_limit // cs)
        t.load_blocks = list(block_ids[0][plan.start * self.s.bpc: -(-(first + t.load_limit) // bs)])
        t.hit_tokens = num_external_tokens
        t.hit_tier = self.attribute(plan, t.load_skip, t.load_limit)
        if plan.is_async:
            keys = plan.keys[:needed]
            pins, plan.pins = plan.pins, []
            t.loading = True
            t.fetch = self.s.spawn(self._fetch(t, keys, pins))
            self.s.metrics.count("async_loads")
        else:
            release_all(plan.objs[needed:])
            plan.objs = plan.objs[:needed]
            plan.keys = plan.keys[:needed]
            self.s.sync_loads.append(t)
            self.s.metrics.count("sync_loads")

    def attribute(self, plan: LoadPlan, skip: int, limit: int) -> dict[str, int]:
        """Hit tokens per tier: the part of each chunk inside ``[skip, limit)``."""
        by_tier: dict[str, int] = {}
        pos = 0
        for key, src in zip(plan.keys, plan.srcs, strict=True):
            lo, hi = max(pos, skip), min(pos + key.num_tokens, limit)
            if hi > lo:
                name = self.s.tier_names[src] if 0 <= src < len(self.s.tier_names) else "unknown"
                by_tier[name] = by_tier.get(name, 0) + hi - lo
            pos += key.num_tokens
        return by_tier

    def ready_fetches(self) -> list[RequestTracker]:
        ready = []
        for t in self.s.trackers.values():
            if t.loading and t.fetch is not None and t.fetch.done():
                t.fetch = None
                t.loading = False
                ready.append(t)
        return ready

    def _describe_loaded(self, t: RequestTracker, key: ChunkKey) -> None:
        if self.s.events is None:
            return
        plan = t.plan
        if plan is None or key not in plan.keys:
            return
        c = plan.start + plan.keys.index(key)
        self.s.events.describe(key, self.s.planner.chunk_info(t.request, c, key.num_tokens))


def _result(task: asyncio.Task, default: Any) -> Any:
    if task.cancelled() or task.exception() is not None:
        return default
    return task.result()
