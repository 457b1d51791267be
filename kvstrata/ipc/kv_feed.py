"""The engine's KV events for its own clients (the fleet router), over the
engine's authenticated DEALER/ROUTER channel.

The engine hands each step's ``KVEventBatch`` to a sink (``AsyncEngine``'s
``kv_events``). In the engine subprocess that sink is a :class:`KVEventFeed`:
it encodes the batch once, numbers it (from 0, no gaps, per engine start),
keeps the last ``buffer_steps`` for replay, and passes it on to

- the engine server's :class:`KVSubscriptions`, which sends
  ``KVEvents(epoch, seq, payload)`` (and the engine's ``LoadReport``s) to
  every client that subscribed (``KVSubscribe(start_seq)``), after
  the buffered batches from ``start_seq``: the same channel, access control
  (ipc peer uid, tcp CURVE) and flow control as the requests, so a fleet
  router needs no second address and no second key;
- the vLLM-compatible ZMQ publisher (``kvstrata.ipc.kv_publisher``) when
  ``cache.kv_events_endpoint`` is set, for other routers (Dynamo, llm-d).

The payload is encoded once, in the shape the feed was given
(``wire_format``, ``int_hashes``: ``cache.kv_events_format`` and
``cache.kv_events_int_hashes``; ``kvstrata.kv.events.KVEventCodec``); the
fleet router's decoder reads every shape. The tee publisher encodes with
its own codec.

``epoch`` is drawn at random when the engine starts: a router that sees a new
epoch drops everything it knew about that engine (its blocks died with the
old process). Nothing here blocks: ``publish`` runs on the engine loop.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import structlog

from kvstrata.ipc import protocol as P
from kvstrata.kv.events import KVEventBatch, KVEventCodec
from kvstrata.types import EngineLoad

if TYPE_CHECKING:  # the engine (torch) is imported after the server binds
    from kvstrata.enginecore.async_engine import AsyncEngine, KVEventSink

log = structlog.get_logger(__name__)


def new_epoch() -> int:
    """A random, non-zero 63-bit epoch (one per engine start)."""
    return secrets.randbits(63) | 1


class KVEventFeed:
    """Owns: the sequence counter, the replay ring of encoded batches, the
    listener (the engine server's broadcast) and the tee publisher it was
    handed (closed by ``aclose``)."""

    def __init__(self, *, epoch: int | None = None, buffer_steps: int = 10_000,
                 tee: KVEventSink | None = None, wire_format: str = "vllm", int_hashes: bool = False) -> None:
        self.codec = KVEventCodec(wire_format, int_hashes=int_hashes)  # ValueError naming the format
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps!r}")
        self.epoch = new_epoch() if epoch is None else epoch
        self.next_seq = 0
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._encode = self.codec.encode
        self._tee = tee
        self.listener: Callable[[int, bytes], None] | None = None

    @property
    def oldest_seq(self) -> int:
        """The first sequence number still in the ring (``next_seq`` when empty)."""
        return self._ring[0][0] if self._ring else self.next_seq

    def position(self) -> P.KVPosition:
        """Where the stream is: this engine start's epoch, the next batch's
        number, and the oldest one the replay ring still holds."""
        return P.KVPosition(self.epoch, self.next_seq, self.oldest_seq)

    def publish(self, batch: KVEventBatch) -> bool:
        seq = self.next_seq
        self.next_seq += 1
        payload = self._encode(batch)
        self._ring.append((seq, payload))
        if self.listener is not None:
            self.listener(seq, payload)
        if self._tee is not None:
            self._tee.publish(batch)
        return True

    def since(self, start_seq: int) -> list[tuple[int, bytes]]:
        """The buffered batches from ``start_seq`` on (later ones only when
        ``start_seq`` already left the ring)."""
        if start_seq >= self.next_seq:
            return []
        first = self.oldest_seq
        skip = max(start_seq - first, 0)
        return [self._ring[i] for i in range(skip, len(self._ring))]

    async def aclose(self) -> None:
        self.listener = None
        tee, self._tee = self._tee, None
        if tee is not None:
            await tee.aclose()


class KVSubscriptions:
    """The engine server's KV event service for its clients: the
    ``GetKVPosition``, ``GetKVSnapshot`` and ``KVSubscribe`` calls and, to
    every subscriber, each batch of the feed and the engine's ``LoadReport``s.

    Owns: the subscribed client identities and the load last reported to
    each (and when). The server owns the clients and the socket; it hands
    in how to send a message (``send``) or an encoded frame
    (``send_encoded``), how to flag a client's protocol error, and
    ``received``: how many AddRequest frames a client has sent (None once
    it is gone). Everything runs on the engine's loop.
    """

    def __init__(self, feed: KVEventFeed, engine: AsyncEngine, *, send: Callable[[bytes, P.Outbound], None],
                 send_encoded: Callable[[bytes, bytes], None], received: Callable[[bytes], int | None]) -> None:
        self.feed = feed
        self._engine = engine
        self._send = send
        self._send_encoded = send_encoded
        self._received = received
        self._encoder = msgspec.msgpack.Encoder()
        # identity -> ((load, received), when) last reported; None: report at the next tick
        self._subscribers: dict[bytes, tuple[tuple[EngineLoad, int], float] | None] = {}
        feed.listener = self._broadcast

    def call(self, identity: bytes, call_id: int, call: P.GetKVPosition | P.GetKVSnapshot | P.KVSubscribe) -> None:
        """``GetKVPosition``: the feed's position; ``GetKVSnapshot``: that
        plus every cache's content now (a msgpack KVEventBatch consistent
        with the stream up to ``next_seq - 1``); ``KVSubscribe``: the
        position, then the buffered batches from ``start_seq``, then every
        later one as it comes, all on this loop, so none is missed or sent
        twice."""
        feed = self.feed
        match call:
            case P.GetKVPosition():
                self._send(identity, P.UtilityResult(call_id, feed.position()))
            case P.GetKVSnapshot():
                payload = feed.codec.encode(self._engine.kv_snapshot())
                self._send(identity, P.UtilityResult(call_id, P.KVSnapshot(
                    feed.epoch, feed.next_seq, feed.oldest_seq, payload)))
            case P.KVSubscribe(start_seq=start):
                self._send(identity, P.UtilityResult(call_id, feed.position()))
                for seq, payload in feed.since(start):
                    self._send(identity, P.KVEvents(feed.epoch, seq, payload))
                self._subscribers[identity] = None  # the next load report goes out whatever it says

    def drop(self, identity: bytes) -> None:
        """A client is gone."""
        self._subscribers.pop(identity, None)

    def _broadcast(self, seq: int, payload: bytes) -> None:
        if not self._subscribers:
            return
        frame = self._encoder.encode(P.KVEvents(self.feed.epoch, seq, payload))  # once for all
        for identity in list(self._subscribers):
            if self._received(identity) is None:
                self.drop(identity)
            else:
                self._send_encoded(identity, frame)

    async def report_load(self) -> None:
        """Every ``LOAD_REPORT_INTERVAL_S``: the engine's load to each
        subscriber whose report would change (its own ``received`` count
        included), and to every one at least each ``LOAD_REPORT_REFRESH_S``
        (a router takes a silent engine's last report as stale), so every
        router sees the work all routers sent here."""
        engine, subscribers = self._engine, self._subscribers
        while True:
            await asyncio.sleep(P.LOAD_REPORT_INTERVAL_S)
            if not subscribers or engine.is_dead:
                continue
            try:
                load = engine.load_now()
            except Exception as e:  # never the end of the reports: the next tick tries again
                log.error("engine_load_report_failed", error=f"{type(e).__name__}: {e}")
                continue
            now = time.monotonic()
            for identity, last in list(subscribers.items()):
                received = self._received(identity)
                if received is None:
                    self.drop(identity)
                    continue
                mark = (load, received)
                if last is None or mark != last[0] or now - last[1] >= P.LOAD_REPORT_REFRESH_S:
                    subscribers[identity] = (mark, now)
                    self._send(identity, P.LoadReport(self.feed.epoch, load, received))
