"""The offload connector's scheduler side: plans loads and saves, does every
store operation (on the event loop), never blocks.

    loads  (``loads.LoadPlanner``)   lookup, promotion, sync or async load
    saves  (``saves.SavePlanner``)   chunks that fill in a step, the unsaved
                                     chunks of finished and preempted requests

Each planner owns its own state and answers; this class applies what one
decides that concerns the other (chunks found in the store need no save;
chunks a load did not deliver do), and settles the worker's report: saved
buffers into the store, loaded ones released.

Steps in flight. With async scheduling step k+1's metadata is built while
step k runs, before k's report is in: everything step-scoped (lent
buffers, bulk loads to retry, finished requests waiting for a save) is kept
per step, under the step number the metadata and the report carry, and
settled when that step comes back (steps come back in order). What a
metadata asks for is safe to build early: a save covers chunks whose
tokens the carrying step or an earlier one computes (the step thread runs
steps in order; a chunk whose last token is still being sampled has no key
yet); a load writes blocks allocated for it, after whatever earlier step
wrote them last, and its request is not scheduled again until the
scheduler knows whether it failed. A failed step drops the saves of the
step queued behind it (``Lender.discard_saves``): they may have read its
KV; so does a failed load, for its request's saves.
"""

from __future__ import annotations

import itertools

import msgspec
import structlog
import torch

from kvstrata.connector.base import BlockIds, BlockTables, ConnectorRequest, ConnectorSpec, KVParams
from kvstrata.connector.events import TierEventRecorder
from kvstrata.connector.metadata import OffloadMetadata, WorkerReport
from kvstrata.connector.metrics import TransferMetrics
from kvstrata.connector.offload.chunks import ChunkGeometry
from kvstrata.connector.offload.lending import Lender
from kvstrata.connector.offload.loads import LoadPlanner, Match
from kvstrata.connector.offload.options import OffloadOptions
from kvstrata.connector.offload.saves import SavePlanner
from kvstrata.connector.offload.segments import SegmentPlanner
from kvstrata.connector.offload.tracker import LoadTracker
from kvstrata.connector.wakeup import Wakeup
from kvstrata.io import L1_SOURCE, StorageManager, StoreIdentity
from kvstrata.kv.events import AnyKVCacheEvent
from kvstrata.types import ModelRunnerOutput, SchedulerOutput

log = structlog.get_logger(__name__)

_STORE_FIELDS = ("hit_tokens", "miss_tokens", "bytes_in", "bytes_out", "evictions", "dropped_puts", "corrupt",
                 "usage_bytes", "num_objects")


class OffloadScheduler:
    """Owns: the step counter and the planners (``loads``: each request's
    lookup, plan and fetch; ``saves``: each request's save progress and the
    bulk saves queued; ``segments``: CacheBlend). Shares the store with the
    worker side only through lent buffers (``lender``), lent per step, and
    the blocks each step in flight loads into, by request. Loop only."""

    def __init__(self, spec: ConnectorSpec, opts: OffloadOptions, store: StorageManager, lender: Lender,
                 *, role: str, events: TierEventRecorder | None, metrics: TransferMetrics,
                 wakeup: Wakeup | None = None) -> None:
        self.opts = opts
        self.store = store
        self.lender = lender
        self.load_enabled = role != "producer"
        self.save_enabled = role != "consumer"
        self.events = events
        self.metrics = metrics
        self.keyer = keyer = store.keyer(_store_identity(spec, opts.chunk_size))  # this engine's chunk keys
        geometry = ChunkGeometry(keyer.fingerprint, spec.block_size, opts.chunk_size)
        dtype = getattr(torch, spec.dtype)
        bytes_per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_size * dtype.itemsize
        self.loads = LoadPlanner(store, geometry, keyer, opts, lender, metrics, events, wakeup or Wakeup(),
                                 bytes_per_token=bytes_per_token)
        self.saves = SavePlanner(store, geometry, lender, metrics, events, num_layers=spec.num_layers,
                                 num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                                 dtype=dtype, save_decode=opts.save_decode,
                                 # a producer saves for its consumer: everything
                                 options=msgspec.structs.replace(opts, save_admission="all")
                                 if role == "producer" else opts)
        self.segments = SegmentPlanner(store, keyer.fingerprint, lender, metrics, self.loads.spawn,
                                       block_size=spec.block_size, num_layers=spec.num_layers,
                                       num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                                       dtype=dtype)
        self._step = itertools.count(1)
        # step -> the blocks each request's loads of that step write, until it comes back
        self._loading: dict[int, dict[str, set[int]]] = {}

    def bind_block_tables(self, tables: BlockTables) -> None:
        self.saves.bind(tables)

    def tracked(self) -> set[str]:
        """The requests either planner still holds state for."""
        return {*self.loads.tracked(), *self.saves.tracked(), *self.segments.tracked()}

    # -- lookup and allocation ---------------------------------------------------------
    def prefetch(self, request: ConnectorRequest) -> None:
        if self.load_enabled:
            self.loads.prefetch(request)

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.load_enabled:
            blend, ext = self.segments.match(request, num_computed_tokens)
            if blend:  # CacheBlend: its segments' own KV, blended within the step
                if ext is not None and self.save_enabled:
                    self.saves.track(request, 0)
                return ext, False
            m = self.loads.match(request, num_computed_tokens)
            if m.tokens is None:
                return None, False
        else:
            m = Match(0, False, num_computed_tokens // self.opts.chunk_size)
        if self.save_enabled:
            self.saves.track(request, m.stored_until)
        return m.tokens, m.load_async

    def load_point(self, request: ConnectorRequest) -> int | None:
        return self.loads.load_point(request) if self.load_enabled else None

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: BlockIds,
                                 num_external_tokens: int) -> None:
        self.loads.allocated(request, block_ids, num_external_tokens)
        self.segments.allocated(request, block_ids, num_external_tokens)

    # -- the step --------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMetadata | None:
        step = next(self._step)
        self.lender.begin(step)
        layer_loads, bulk_loads = self.loads.hand_over(step)
        for h in (*layer_loads, *bulk_loads):
            if h.resave_from is not None:
                self.saves.rewind(h.transfer.req_id, h.resave_from)
        bulk_saves, finishing = self.saves.take_bulk(step)
        layer_saves = self.saves.layer_saves(scheduler_output) if self.save_enabled else []
        meta = OffloadMetadata(step=step, layer_loads=[h.transfer for h in layer_loads],
                               bulk_loads=[h.transfer for h in bulk_loads], bulk_saves=bulk_saves,
                               layer_saves=layer_saves, finishing=finishing,
                               blend_loads=self.segments.hand_over(),
                               num_tokens=scheduler_output.total_num_scheduled_tokens)
        loading = _blocks_loaded(meta)
        if loading:
            self._loading[step] = loading
        return None if meta.is_empty else meta

    def update_connector_output(self, runner_output: ModelRunnerOutput) -> None:
        """Settle the step the worker reports on (a step with no metadata has
        no report, and nothing lent or waiting)."""
        report = runner_output.kv_connector_stats
        if isinstance(report, WorkerReport):
            self._load_failures(report.step, set(runner_output.invalid_block_ids))
            self.saves.put(self.lender.settle(report))
            self.metrics.observe_forward(report.forward_s, report.forward_tokens)
            for rid, seconds in report.load_s.items():
                self.loads.add_load_time(rid, seconds)
            self.loads.step_done(report.step)
            self.saves.step_done(report.step)
        if self.events is not None:
            self.events.sweep_evicted(self.store.source_name(L1_SOURCE), self.store.l1_evictions, self.store.in_l1)

    def step_failed(self, scheduler_output: SchedulerOutput) -> tuple[list[str], list[str], list[int]]:
        """The step raised: its buffers are released (saves dropped), and so
        are the saves of a step queued behind it (it may have read the failed
        step's KV); returns (finished requests whose blocks may be freed,
        requests whose bulk load did not happen, the blocks they must recompute)."""
        meta = scheduler_output.kv_connector_metadata
        step = meta.step if isinstance(meta, OffloadMetadata) else None
        if step is not None:
            self.lender.release_step(step)
            self._step_loading(step)
        self.lender.discard_saves()
        recving, invalid = self.loads.step_failed(step)
        return self.saves.step_failed(step), recving, invalid

    def _load_failures(self, step: int, invalid: set[int]) -> None:
        """The requests whose loads in ``step`` hit ``invalid`` blocks computed
        over KV that is not there: their saves of that step and of the steps
        after it are dropped, and they save again from the first failed
        block's chunk (they recompute from there)."""
        loading = self._step_loading(step)
        if not invalid or not loading:
            return
        failed = {rid for rid, blocks in loading.items() if not blocks.isdisjoint(invalid)}
        self.lender.discard_saves(failed)
        for rid in failed:
            self.saves.load_failed(rid, invalid)

    def _step_loading(self, step: int) -> dict[str, set[int]]:
        """Take the loads of ``step`` (and forget those of the steps before it: done)."""
        for s in [s for s in self._loading if s < step]:
            del self._loading[s]
        return self._loading.pop(step, {})

    # -- lifecycle of requests ---------------------------------------------------------
    def request_preempted(self, request: ConnectorRequest, block_ids: BlockIds) -> None:
        self.loads.preempted(request.request_id)
        self.segments.finish(request.request_id)
        if self.save_enabled and self.opts.save_on_preempt:
            self.saves.preempted(request, block_ids[0])

    def request_finished(self, request: ConnectorRequest, block_ids: BlockIds) -> tuple[bool, KVParams | None]:
        self.segments.finish(request.request_id)
        load = self.loads.finish(request.request_id)
        if load is not None:
            self._book(load)
        save = (request.finish_reason in ("stop", "length") and self.opts.save_on_finish
                and bool(block_ids) and bool(block_ids[0]))
        return self.saves.finish(request, block_ids[0] if save else None), None

    def _book(self, t: LoadTracker) -> None:
        """A finished request's last lookup and load, into the per-tier books:
        its queried tokens and its hits, in one place, so every tier's hit
        rate (hit_tokens / query_tokens) is counted from the same requests."""
        self.metrics.count("query_tokens", t.query_tokens)
        if not t.hit_tokens:
            return
        rec = self.metrics.request_done(t.req_id, t.hit_tier, t.load_s, 0)
        log.info("kv_transfer_request", request_id=t.req_id, hit_tokens=rec.hit_tokens,
                 by_tier=rec.hit_tokens_by_tier, load_s=round(rec.load_s, 6), saved_s_est=round(rec.saved_s_est, 6))

    # -- misc --------------------------------------------------------------------------
    def take_events(self) -> list[AnyKVCacheEvent]:
        return [] if self.events is None else self.events.take()

    def snapshot_events(self) -> list[AnyKVCacheEvent]:
        return [] if self.events is None else self.events.snapshot()

    def stats(self) -> dict[str, float]:
        out = self.metrics.as_dict()
        for ts in self.store.stats().tiers:
            for field in _STORE_FIELDS:
                out[f"store.{ts.name}.{field}"] = float(getattr(ts, field))
            out[f"store.{ts.name}.available"] = float(ts.available)
        out.update(self.saves.stats())
        for name, rate in self.store.read_rates().items():
            out.update(rate.as_dict(f"store.{name}"))
        return out

    def hit_tokens(self) -> int:
        return self.metrics.total_hit_tokens()

    def has_pending_work(self) -> bool:
        return (self.loads.has_pending() or self.saves.has_pending() or self.segments.has_pending()
                or len(self.lender) > 0)

    async def aclose(self) -> None:
        self.segments.close()
        await self.loads.aclose()
        self.saves.close()
        self.lender.release_all()
        self._loading.clear()


def _blocks_loaded(meta: OffloadMetadata) -> dict[str, set[int]]:
    """The blocks each request's loads in ``meta`` write (failed ones included)."""
    out: dict[str, set[int]] = {}
    for rt in (*meta.layer_loads, *meta.bulk_loads):
        blocks = out.setdefault(rt.req_id, set())
        blocks.update(rt.failed_block_ids)
        for ch in rt.chunks:
            blocks.update(ch.block_ids)
    for bl in meta.blend_loads:
        out.setdefault(bl.req_id, set()).update(bl.block_ids)
    return out


def _store_identity(spec: ConnectorSpec, chunk_size: int) -> StoreIdentity:
    ident = spec.identity
    return StoreIdentity(model_fingerprint=ident.model_fingerprint, kv_dtype=ident.kv_dtype,
                         kv_layout=ident.kv_layout, block_size=ident.block_size, hash_algo=ident.hash_algo,
                         namespace=ident.namespace, chunk_size=chunk_size)
