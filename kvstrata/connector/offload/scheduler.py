"""The offload connector's scheduler side: plans loads and saves, does every
store operation (on the event loop), never blocks.

Loads: see ``loads.LoadPlanner`` (lookup, promotion, sync or async load).
Saves (``build_connector_meta``): chunks that fill in this step (prefill;
decode if ``save_decode``), gathered after each layer; the unsaved chunks of
finished and preempted requests, gathered before the forward. Buffers come
from L1 now; the worker's report puts them into the store
(``update_connector_output``).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import structlog
import torch

from kvstrata.io import StorageManager
from kvstrata.connector.base import ConnectorSpec
from kvstrata.connector.events import TierEventRecorder
from kvstrata.connector.metadata import OffloadMetadata, WorkerReport
from kvstrata.connector.metrics import TransferMetrics
from kvstrata.connector.offload.lending import Lender
from kvstrata.connector.offload.loads import LoadPlanner
from kvstrata.connector.offload.options import OffloadOptions
from kvstrata.connector.offload.saves import SavePlanner
from kvstrata.connector.offload.tracker import RequestTracker

log = structlog.get_logger(__name__)


class OffloadScheduler:
    """Owns: one tracker per live request, the step counter, the loads and
    saves waiting for the next metadata, the lent buffers (``lender``), the
    metrics and the tasks it started. Shares the store with the worker side
    only through lent buffers."""

    def __init__(self, spec: ConnectorSpec, opts: OffloadOptions, store: StorageManager, lender: Lender,
                 *, role: str, events: TierEventRecorder | None, metrics: TransferMetrics) -> None:
        self.spec = spec
        self.opts = opts
        self.store = store
        self.lender = lender
        self.loads = role != "producer"
        self.saves = role != "consumer"
        self.events = events
        self.metrics = metrics
        self.tier_names = [store.l1.name] + [t.name for t in store.tiers]
        self.keyer = store.keyer(_store_identity(spec, opts.chunk_size))
        self.fingerprint = self.keyer.fingerprint
        self.chunk_size = opts.chunk_size
        self.bpc = opts.chunk_size // spec.block_size
        self.planner = SavePlanner(self, torch.empty((), dtype=getattr(torch, spec.dtype)).dtype)
        self.loader = LoadPlanner(self)
        self.trackers: dict[str, RequestTracker] = {}
        self.sync_loads: list[RequestTracker] = []
        self.prefetched: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._step = itertools.count(1)
        self._current_step = 0

    # -- lookup and allocation (see offload/loads.py) -------------------------
    def prefetch(self, request: Any) -> None:
        self.loader.prefetch(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.loader.match(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        self.loader.allocated(request, block_ids, num_external_tokens)

    # -- the step ------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> OffloadMetadata | None:
        self._track_blocks(scheduler_output)
        step = self._current_step = next(self._step)
        layer_loads = [self.planner.lend_loads(t, t.plan.objs if t.plan else [], layerwise=True)
                       for t in self.sync_loads]
        self.sync_loads = []
        bulk_loads = [self.planner.lend_loads(t, t.fetched or [], layerwise=False) for t in self.loader.ready_fetches()]
        bulk_saves, finishing = self.planner.take_bulk()
        layer_saves = self.planner.layer_saves(scheduler_output) if self.saves else []
        meta = OffloadMetadata(step=step, layer_loads=layer_loads, bulk_loads=bulk_loads, bulk_saves=bulk_saves,
                               layer_saves=layer_saves, finishing=finishing,
                               num_tokens=scheduler_output.total_num_scheduled_tokens)
        return None if meta.is_empty else meta

    def _track_blocks(self, so: Any) -> None:
        trackers = self.trackers
        for data in so.scheduled_new_reqs:
            t = trackers.get(data.req_id)
            if t is not None:
                t.block_ids = list(data.block_ids[0])
        cached = so.scheduled_cached_reqs
        for rid, new in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if new is not None:
                t = trackers.get(rid)
                if t is not None:
                    t.block_ids.extend(new[0])

    def update_connector_output(self, runner_output: Any) -> None:
        report = getattr(runner_output, "kv_connector_stats", None)
        if isinstance(report, WorkerReport):
            self.planner.settle(report)
            self.metrics.observe_forward(report.forward_s, report.forward_tokens)
            for rid, seconds in report.load_s.items():
                t = self.trackers.get(rid)
                if t is not None:
                    t.load_s += seconds
        self.planner.settle_leftovers()
        if self.events is not None:
            self.events.sweep_l1(self.store.l1)

    def step_failed(self, scheduler_output: Any) -> tuple[list[str], list[str], list[int]]:
        """The step raised: its buffers are released (saves dropped); returns
        (finished requests whose blocks may be freed, requests whose bulk load
        did not happen, the blocks they must recompute)."""
        return self.planner.fail_step()

    # -- lifecycle of requests -------------------------------------------------
    def request_preempted(self, request: Any, block_ids: tuple[list[int], ...]) -> None:
        t = self.trackers.get(request.request_id)
        if t is None:
            return
        t.drop_plan()
        if self.saves and self.opts.save_on_preempt:
            self.planner.queue_bulk(t, request.num_computed_tokens, block_ids[0], finishing=False)
        t.block_ids = []

    def request_finished(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        t = self.trackers.pop(request.request_id, None)
        self.prefetched.discard(request.request_id)
        if t is None:
            return False, None
        t.finished = True
        t.drop_plan()
        if t in self.sync_loads:
            self.sync_loads.remove(t)
        self._book(t)
        ok = getattr(request, "finish_reason", None) in ("stop", "length")
        if ok and self.saves and self.opts.save_on_finish and block_ids and block_ids[0]:
            if self.planner.queue_bulk(t, request.num_computed_tokens, block_ids[0], finishing=True):
                return True, None
        return False, None

    def _book(self, t: RequestTracker) -> None:
        if not t.hit_tokens:
            return
        rec = self.metrics.request_done(t.req_id, t.hit_tier, t.load_s, 0)
        log.info("kv_transfer_request", request_id=t.req_id, hit_tokens=rec.hit_tokens,
                 by_tier=rec.hit_tokens_by_tier, load_s=round(rec.load_s, 6), saved_s_est=round(rec.saved_s_est, 6))

    # -- misc ------------------------------------------------------------------
    def take_events(self) -> list:
        return [] if self.events is None else self.events.take()

    def stats(self) -> dict[str, float]:
        out = self.metrics.as_dict()
        for ts in self.store.stats().tiers:
            for field in ("hit_tokens", "miss_tokens", "bytes_in", "bytes_out", "evictions", "dropped_puts",
                          "corrupt", "usage_bytes", "num_objects"):
                out[f"store.{ts.name}.{field}"] = float(getattr(ts, field))
            out[f"store.{ts.name}.available"] = float(ts.available)
        return out

    def has_pending_work(self) -> bool:
        return bool(self._tasks) or bool(self.sync_loads) or self.planner.has_pending() or len(self.lender) > 0

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def aclose(self) -> None:
        for t in list(self.trackers.values()):
            t.finished = True
            t.drop_plan()
        self.trackers.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.planner.close()


def _store_identity(spec: ConnectorSpec, chunk_size: int):
    from kvstrata.io import StoreIdentity

    ident = spec.identity
    return StoreIdentity(model_fingerprint=ident.model_fingerprint, kv_dtype=ident.kv_dtype,
                         kv_layout=ident.kv_layout, block_size=ident.block_size, hash_algo=ident.hash_algo,
                         namespace=ident.namespace, chunk_size=chunk_size)
