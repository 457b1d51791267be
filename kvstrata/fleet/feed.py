"""The router's feed from the fleet's replicas: each replica's KV events and
load reports, which arrive over the replica's own engine socket
(``MPEngineClient.subscribe_kv_events``).

Each KV batch is numbered: a gap is seen by the router's index and replayed
from the engine's ring or, when the ring no longer holds it, rebuilt from a
snapshot of the engine's caches (``kv_snapshot``), then followed from
there. Frames of a replica's older epoch (an engine that restarted) are
dropped. A load report becomes the replica's engine load, which the owner
pushes to the router (``on_load``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from functools import partial

import msgspec
import structlog

from kvstrata.errors import EngineDeadError
from kvstrata.fleet.replica import Replica
from kvstrata.ipc import protocol as P
from kvstrata.kv.events import make_batch_decoder
from kvstrata.router import Router

log = structlog.get_logger(__name__)


class FeedCounters(msgspec.Struct, kw_only=True):
    kv_batches: int = 0
    kv_replays: int = 0
    kv_snapshots: int = 0
    load_reports: int = 0  # engines' LoadReports applied


class KVFeed:
    """Owns: the KV batch decoder and the set of replicas being replayed.
    Reads the fleet's replicas (``replicas``, the owner's map) and writes
    only the router's index, a replica's engine load (``Replica.note_load``)
    and the ``counters`` it is given (the fleet's, which it reports)."""

    def __init__(self, router: Router, replicas: Mapping[str, Replica], on_load: Callable[[Replica], None],
                 counters: FeedCounters) -> None:
        self._router = router
        self._replicas = replicas
        self._on_load_changed = on_load
        self._decode_batch = make_batch_decoder().decode
        self._replaying: set[str] = set()
        self._loop = asyncio.get_running_loop()
        self.counters = counters

    async def subscribe(self, replica: Replica, start_seq: int | None = None) -> None:
        """Follow ``replica``'s KV events from ``start_seq`` (default: the
        next batch the index expects), through a snapshot when the engine's
        ring no longer holds it."""
        client = replica.client
        if client is None:
            raise EngineDeadError(f"replica {replica.name} is not connected")
        if start_seq is None:
            start_seq = self._router.index.expected_seq(replica.name) or 0
        if start_seq < (await client.kv_position()).oldest_seq:
            snap = await client.kv_snapshot()
            if snap.epoch != replica.epoch:
                raise EngineDeadError(f"replica {replica.name} restarted during the snapshot")
            self._router.index.load_snapshot(replica.name, replica.epoch, snap.next_seq,
                                             self._decode_batch(snap.payload))
            self.counters.kv_snapshots += 1
            log.info("fleet_kv_snapshot_loaded", replica=replica.name, wanted_seq=start_seq, next_seq=snap.next_seq)
            start_seq = snap.next_seq
        await client.subscribe_kv_events(partial(self._on_kv_events, replica.name, replica.epoch), start_seq,
                                         load_listener=partial(self._on_load, replica.name, replica.epoch))

    def _on_load(self, name: str, epoch: int, msg: P.LoadReport) -> None:
        """The engine's queued work (every router's requests): the replica's
        load from now on (``Replica.load``)."""
        replica = self._replicas.get(name)
        if replica is None or msg.epoch != epoch or replica.epoch != epoch:
            return
        replica.note_load(msg.load, msg.received)
        self.counters.load_reports += 1
        self._on_load_changed(replica)

    def _on_kv_events(self, name: str, epoch: int, msg: P.KVEvents) -> None:
        if msg.epoch != epoch or name not in self._replicas:
            return
        try:
            batch = self._decode_batch(msg.payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.error("fleet_kv_events_undecodable", replica=name, seq=msg.seq, error=str(e))
            return
        res = self._router.ingest(name, msg.seq, batch, epoch=epoch)
        self.counters.kv_batches += 1
        if res.action == "gap" and name not in self._replaying:
            self._replaying.add(name)
            self.counters.kv_replays += 1
            log.warning("fleet_kv_gap", replica=name, seq=msg.seq, expected_seq=res.expected_seq)
            task = self._loop.create_task(self._replay(self._replicas[name], res.expected_seq or 0))
            task.add_done_callback(lambda _t, n=name: self._replaying.discard(n))

    async def _replay(self, replica: Replica, start_seq: int) -> None:
        try:
            if replica.live:
                await self.subscribe(replica, start_seq)
        except (EngineDeadError, RuntimeError) as e:
            log.warning("fleet_kv_replay_failed", replica=replica.name, error=str(e))
