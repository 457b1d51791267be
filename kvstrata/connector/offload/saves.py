"""The transfers of one step, on the scheduler side: which chunks to save,
with which L1 buffers; which loaded chunks to hand over; and settling the
worker's report (buffers put into the store, or released).

A save buffer is allocated from L1 when the step's metadata is built
(``StorageManager.allocate``: evicts as needed, None when it cannot: the save
is skipped and counted, it is a cache). A chunk some tier already holds is
not saved again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvstrata.io import ChunkKey
from kvstrata.io.memory import release_all
from kvstrata.connector.events import ChunkInfo
from kvstrata.connector.metadata import ChunkTransfer, RequestTransfer, WorkerReport
from kvstrata.connector.offload.lending import Lent
from kvstrata.connector.offload.tracker import RequestTracker

if TYPE_CHECKING:
    from kvstrata.connector.offload.scheduler import OffloadScheduler


class _Bulk:
    __slots__ = ("req_id", "request", "chunks", "block_ids", "finishing")

    def __init__(self, req_id: str, request: Any, chunks: list, block_ids: list[int], finishing: bool) -> None:
        self.req_id, self.request, self.chunks = req_id, request, chunks
        self.block_ids, self.finishing = block_ids, finishing


class SavePlanner:
    """Owns: the bulk saves queued for the next step, the ids of finished
    requests whose blocks wait for them, and the bulk loads of the step in
    flight (to retry their requests if the step fails). Loop only."""

    def __init__(self, sched: OffloadScheduler, dtype: torch.dtype) -> None:
        self.s = sched
        self.dtype = dtype
        spec = sched.spec
        self.geometry = (spec.num_layers, 2, 0, spec.num_kv_heads, spec.head_size)
        self._bulk: list[_Bulk] = []
        self._step_finishing: list[str] = []
        self._step_bulk_loads: list[tuple[str, list[int]]] = []

    # -- saves -----------------------------------------------------------------
    def queue_bulk(self, t: RequestTracker, upto_tokens: int, block_ids: list[int], *, finishing: bool) -> bool:
        """Queue the request's unsaved chunks among its first ``upto_tokens``;
        False when there are none."""
        s = self.s
        req, cs, bs, bpc = t.request, s.chunk_size, s.spec.block_size, s.bpc
        bh = req.block_hashes
        n_full = min(upto_tokens // cs, len(bh) // bpc)
        chunks = [(c, ChunkKey(s.fingerprint, bh[(c + 1) * bpc - 1], cs), cs) for c in range(t.next_save, n_full)]
        nb = min(upto_tokens // bs, len(bh))
        if s.store.config.save_partial_chunks and nb > n_full * bpc and n_full >= t.next_save:
            n = (nb - n_full * bpc) * bs  # the partial chunk: up to the last computed full block
            chunks.append((n_full, ChunkKey(s.fingerprint, bh[nb - 1], n), n))
        t.next_save = max(t.next_save, n_full)
        if not chunks:
            return False
        self._bulk.append(_Bulk(t.req_id, req, chunks, list(block_ids), finishing))
        return True

    def take_bulk(self) -> tuple[list[RequestTransfer], list[str]]:
        bulk, self._bulk = self._bulk, []
        out = [rt for b in bulk if (rt := self._lend_saves(b.req_id, b.request, b.chunks, b.block_ids))]
        self._step_finishing = [b.req_id for b in bulk if b.finishing]
        return out, list(self._step_finishing)

    def layer_saves(self, so: Any) -> list[RequestTransfer]:
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
        s = self.s
        t = s.trackers.get(rid)
        if t is None:
            return
        c_end = (nc + n) // s.chunk_size
        if c_end <= t.next_save:
            return
        req = t.request
        if nc >= req.num_prompt_tokens and not s.opts.save_decode:
            return  # decode: saved when the request finishes or is preempted
        bpc, cs, bh = s.bpc, s.chunk_size, req.block_hashes
        c_end = min(c_end, len(bh) // bpc)
        chunks = [(c, ChunkKey(s.fingerprint, bh[(c + 1) * bpc - 1], cs), cs) for c in range(t.next_save, c_end)]
        t.next_save = max(t.next_save, c_end)
        rt = self._lend_saves(rid, req, chunks, t.block_ids)
        if rt is not None:
            out.append(rt)

    def _lend_saves(self, rid: str, req: Any, chunks: list, block_ids: list[int]) -> RequestTransfer | None:
        s = self.s
        store, metrics, events, bs, bpc = s.store, s.metrics, s.events, s.spec.block_size, s.bpc
        L, two, _, H, D = self.geometry
        transfers = []
        for c, key, n in chunks:
            if self._stored(key):
                metrics.count("skipped_saves")
                continue
            blocks = block_ids[c * bpc: c * bpc + -(-n // bs)]
            if len(blocks) * bs < n:
                continue  # the request no longer holds these blocks
            obj = store.allocate((L, two, n, H, D), self.dtype, "kv")
            if obj is None:
                metrics.count("dropped_saves")
                continue
            info = self.chunk_info(req, c, n) if events is not None else None
            handle = s.lender.lend(Lent(obj, key, "save", rid, info))
            transfers.append(ChunkTransfer(handle, blocks, 0, n))
        return RequestTransfer(rid, transfers) if transfers else None

    def _stored(self, key: ChunkKey) -> bool:
        store = self.s.store
        if store.l1.contains(key):
            return True
        return any(t.available and t.has(key) is True for t in store.tiers)

    def chunk_info(self, req: Any, c: int, n: int) -> ChunkInfo:
        s = self.s
        bs, bpc, cs = s.spec.block_size, s.bpc, s.chunk_size
        bh = req.block_hashes
        first = c * bpc
        return ChunkInfo(bh[first: first + -(-n // bs)], bh[first - 1] if first else None,
                         req.all_token_ids[c * cs: c * cs + n])

    # -- loads -----------------------------------------------------------------
    def lend_loads(self, t: RequestTracker, objs: list, *, layerwise: bool) -> RequestTransfer:
        """Hand ``objs`` (the plan's leading chunks, references owned from now
        on by the lender) to the worker; blocks of chunks not delivered are
        reported failed, so the scheduler recomputes them."""
        s = self.s
        plan, bs = t.plan, s.spec.block_size
        keys = plan.keys if plan is not None else []
        if plan is not None:
            plan.objs = []
        t.fetched = None
        skip, limit, blocks = t.load_skip, t.load_limit, t.load_blocks
        transfers, pos = [], 0
        for key, obj in zip(keys, objs, strict=False):  # objs: the leading chunks delivered
            lo, hi = max(0, skip - pos), min(key.num_tokens, limit - pos)
            handle = s.lender.lend(Lent(obj, key, "load", t.req_id))
            if hi > lo:
                transfers.append(ChunkTransfer(handle, blocks[pos // bs: -(-(pos + hi) // bs)], lo, hi))
            pos += key.num_tokens
        release_all(objs[len(keys):])
        failed: list[int] = []
        if pos < limit:
            first_bad = max(pos, skip)
            failed = blocks[first_bad // bs:]
            s.metrics.count("load_failed_tokens", limit - first_bad)
            if plan is not None:
                t.hit_tier = s.loader.attribute(plan, skip, first_bad)
                t.hit_tokens = max(0, first_bad - skip)
                t.next_save = min(t.next_save, plan.start + len(objs))
        s.metrics.count("load_chunks", len(transfers))
        if not layerwise:
            self._step_bulk_loads.append((t.req_id, blocks[skip // bs:]))
        t.drop_plan()
        return RequestTransfer(t.req_id, transfers, failed)

    # -- settling the step -----------------------------------------------------
    def settle(self, report: WorkerReport) -> None:
        s = self.s
        take = s.lender.take
        for handle in report.saved:
            entry = take(handle)
            if entry is not None:
                self._put(entry)
        for handle in (*report.loaded, *report.failed):
            entry = take(handle)
            if entry is not None:
                entry.obj.release()
        self._step_finishing = []
        self._step_bulk_loads = []

    def _put(self, entry: Lent) -> None:
        s = self.s
        events, key = s.events, entry.key
        if events is not None and entry.info is not None:
            events.describe(key, entry.info)
        s.store.put(key, entry.obj)
        entry.obj.release()
        s.metrics.count("saved_chunks")
        if events is not None:
            if s.store.l1.contains(key):
                events.stored(key, s.store.l1.name)
            else:
                events.forget(key)

    def settle_leftovers(self) -> None:
        """Release whatever the worker did not report (a step without a report)."""
        release_all([e.obj for e in self.s.lender.take_all()])

    def fail_step(self) -> tuple[list[str], list[str], list[int]]:
        """After a failed step: (finished requests to free, requests whose bulk
        load did not happen, their blocks: to recompute)."""
        self.settle_leftovers()
        finishing, self._step_finishing = self._step_finishing, []
        loads, self._step_bulk_loads = self._step_bulk_loads, []
        return finishing, [rid for rid, _ in loads], [b for _, blocks in loads for b in blocks]

    def has_pending(self) -> bool:
        return bool(self._bulk)

    def close(self) -> None:
        self._bulk = []
        self.settle_leftovers()
