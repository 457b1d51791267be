"""The engine's KV events for its own clients (the fleet router), over the
engine's authenticated DEALER/ROUTER channel.

The engine hands each step's ``KVEventBatch`` to a sink (``AsyncEngine``'s
``kv_events``). In the engine subprocess that sink is a :class:`KVEventFeed`:
it encodes the batch once, numbers it (from 0, no gaps, per engine start),
keeps the last ``buffer_steps`` for replay, and passes it on to

- the engine server, which sends ``KVEvents(epoch, seq, payload)`` to every
  client that subscribed (``Utility("kv_subscribe", [start_seq])``), after
  the buffered batches from ``start_seq``: the same channel, access control
  (ipc peer uid, tcp CURVE) and flow control as the requests, so a fleet
  router needs no second address and no second key;
- the vLLM-compatible ZMQ publisher (``kvstrata.ipc.kv_publisher``) when
  ``cache.kv_events_endpoint`` is set, for other routers (Dynamo, llm-d).

``epoch`` is drawn at random when the engine starts: a router that sees a new
epoch drops everything it knew about that engine (its blocks died with the
old process). Nothing here blocks: ``publish`` runs on the engine loop.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from kvstrata.kv.events import KVEventBatch

if TYPE_CHECKING:  # the engine (torch) is imported after the server binds
    from kvstrata.enginecore.async_engine import KVEventSink


KV_EVENTS_OFF = "KV events are off on this engine (cache.enable_kv_events)"


def new_epoch() -> int:
    """A random, non-zero 63-bit epoch (one per engine start)."""
    return secrets.randbits(63) | 1


class KVEventFeed:
    """Owns: the sequence counter, the replay ring of encoded batches, the
    listener (the engine server's broadcast) and the tee publisher it was
    handed (closed by ``aclose``)."""

    def __init__(self, *, epoch: int | None = None, buffer_steps: int = 10_000,
                 tee: KVEventSink | None = None) -> None:
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps!r}")
        self.epoch = new_epoch() if epoch is None else epoch
        self.next_seq = 0
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._encode = msgspec.msgpack.Encoder().encode
        self._tee = tee
        self.listener: Callable[[int, bytes], None] | None = None

    @property
    def oldest_seq(self) -> int:
        """The first sequence number still in the ring (``next_seq`` when empty)."""
        return self._ring[0][0] if self._ring else self.next_seq

    def position(self) -> dict[str, int]:
        """Where the stream is: this engine start's epoch, the next batch's
        number, and the oldest one the replay ring still holds."""
        return {"epoch": self.epoch, "next_seq": self.next_seq, "oldest_seq": self.oldest_seq}

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
