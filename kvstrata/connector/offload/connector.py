"""OffloadConnector: the tiered store (``kvstrata.io``) as the engine's KV
connector, so that a prefix computed once is reused from whichever tier
still holds it.

    connector = await OffloadConnector.open(KVTransferConfig(options={
        "store": {"cpu": {"capacity_bytes": 1 << 30},
                  "tiers": [{"type": "disk", "options": {"path": "/var/kv", "capacity_bytes": 1 << 34}}]},
        "chunk_size": 256}))
    sched = connector.scheduler_side(spec)       # to the Scheduler
    worker = connector.worker_side(spec)         # to the ModelRunner
    connector.set_wakeup(wake)                   # the engine's: lookups, loads, store writes done
    ...
    await connector.aclose()                     # drains queued writes, closes the tiers

``open`` runs on the engine's event loop: the store and its tiers belong to
that loop. The scheduler side does every store operation there; the worker
side only copies bytes in and out of the buffers the scheduler side lends it.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from kvstrata.connector.base import ConnectorOpener, ConnectorSpec
from kvstrata.connector.config import KVTransferConfig, decode_options
from kvstrata.connector.events import ObservedTier, TierEventRecorder
from kvstrata.connector.metrics import TransferMetrics
from kvstrata.connector.offload.lending import Lender
from kvstrata.connector.offload.options import OffloadOptions
from kvstrata.connector.offload.scheduler import OffloadScheduler
from kvstrata.connector.offload.worker import OffloadWorker
from kvstrata.connector.wakeup import Wakeup
from kvstrata.io import LowerTier, StorageManager, TierRegistry

log = structlog.get_logger(__name__)


class OffloadConnector:
    """Owns: the StorageManager, the lender shared by its two sides, the
    event recorder (when events are on), the metrics, the engine's wake-up
    (shared by the scheduler side and the store), and the sides it built."""

    def __init__(self, config: KVTransferConfig, opts: OffloadOptions, store: StorageManager,
                 events: TierEventRecorder | None) -> None:
        self.config = config
        self.opts = opts
        self.store = store
        self.events = events
        self.lender = Lender()
        self.metrics = TransferMetrics(store.tier_names)
        self.wakeup = Wakeup()
        store.set_write_listener(self.wakeup)  # a written chunk: events to publish, a flush nearer
        self.scheduler: OffloadScheduler | None = None
        self.worker: OffloadWorker | None = None
        self._closed = False

    @classmethod
    async def open(cls, config: KVTransferConfig, factory: ConnectorOpener | None = None,
                   prefix: str = "kv_transfer.options") -> OffloadConnector:
        config.validate()
        opts: OffloadOptions = decode_options(config.options, OffloadOptions, prefix)
        registry = TierRegistry()
        tiers: list[LowerTier] = [registry.build(spec, f"{prefix}.store.tiers[{i}]")
                                  for i, spec in enumerate(opts.store.tiers)]
        events = None
        if opts.enable_events:
            kinds = {"cpu": "cpu", **{t.name: t.kind for t in tiers}}
            events = TierEventRecorder(kinds, block_size=1)
            tiers = [ObservedTier(t, events) for t in tiers]  # type: ignore[misc]  # a LowerTier by forwarding
        store = StorageManager(opts.store, tiers=tiers)
        await store.start()
        log.info("offload_connector_opened", role=config.role, chunk_size=opts.chunk_size,
                 tiers=store.tier_names, load_mode=opts.load_mode)
        return cls(config, opts, store, events)

    def scheduler_side(self, spec: ConnectorSpec) -> OffloadScheduler:
        if self.scheduler is not None:
            raise RuntimeError("the offload connector's scheduler side was already built")
        self._check(spec)
        if self.events is not None:
            self.events.block_size = spec.block_size
        self.scheduler = OffloadScheduler(spec, self.opts, self.store, self.lender, role=self.config.role,
                                          events=self.events, metrics=self.metrics, wakeup=self.wakeup)
        return self.scheduler

    def worker_side(self, spec: ConnectorSpec) -> OffloadWorker:
        if self.worker is not None:
            raise RuntimeError("the offload connector's worker side was already built")
        self._check(spec)
        self.worker = OffloadWorker(spec, self.lender.buffers, batched_layer_transfers=self.opts.batched_layer_transfers,
                                    staged_layer_transfers=self.opts.staged_layer_transfers)
        return self.worker

    def _check(self, spec: ConnectorSpec) -> None:
        if self.opts.chunk_size % spec.block_size:
            raise ValueError(
                f"kv_transfer.options.chunk_size ({self.opts.chunk_size}) must be a multiple of "
                f"cache.block_size ({spec.block_size})"
            )

    def set_wakeup(self, callback: Callable[[], None]) -> None:
        self.wakeup.set(callback)

    async def flush(self) -> None:
        """Wait until every queued write has reached its tier."""
        await self.store.drain()

    async def aclose(self) -> None:
        """Cancel lookups and fetches, release every buffer, drain and close
        the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.scheduler is not None:
                await self.scheduler.aclose()
        finally:
            self.wakeup.set(None)
            await self.store.aclose()
