"""One engine replica as the fleet sees it: how to (re)connect to it, its
live connection, whether it serves, and this fleet's requests there.

    local   an engine subprocess this process started (``serve --engines N``):
            when it dies, the fleet starts a new one (a new epoch)
    remote  an engine at an address (``kvstrata engine --listen tcp://...``, or
            one found in the registry): when it is unreachable, the fleet
            tries to connect again every ``retry_interval_s``

Liveness is kept here and only here (``Replica.live``); the fleet pushes
each change this object reports to the router (``mark_alive`` /
``mark_dead``), so the router's live set is a copy that is never read back:

    open() ──► (attached) ──mark_live()──► live ──mark_down(reason)──► down ─┐
      ▲                                                                      │
      └────────────────────────── the fleet brings it back ◄─────────────────┘
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from itertools import islice

import msgspec
import structlog

from kvstrata.config import EngineConfig
from kvstrata.ipc import protocol as P
from kvstrata.ipc.mp_client import MPEngineClient
from kvstrata.router import ReplicaLoad
from kvstrata.types import EngineLoad

log = structlog.get_logger(__name__)

Connector = Callable[[], Awaitable[MPEngineClient]]


def local_connector(config: EngineConfig, transport: str = "ipc", *,
                    startup_timeout_s: float = 300.0) -> Connector:
    """Start an engine subprocess (KV events on for the router) and connect."""
    config = msgspec.structs.replace(config, cache=msgspec.structs.replace(config.cache, enable_kv_events=True))

    async def start() -> MPEngineClient:
        return await MPEngineClient.start(config, transport=transport, startup_timeout_s=startup_timeout_s)

    return start


def remote_connector(address: str, credentials: P.Credentials | None = None, *,
                     timeout_s: float = 10.0) -> Connector:
    """Connect to a running engine (tcp:// needs its owner's CURVE keys)."""

    async def connect() -> MPEngineClient:
        return await MPEngineClient.connect(address, credentials=credentials, timeout_s=timeout_s)

    return connect


def load_of(inflight: Mapping[str, int], report: EngineLoad | None, received: int, sent: int) -> ReplicaLoad:
    """A replica's work for the router. ``inflight``: this fleet's requests
    there (id -> prompt tokens still to prefill, dispatch order);
    ``report``: the engine's last load report, None when there is none or
    it is stale; ``received`` of our requests it had taken in then, of
    ``sent``. With a report: its work (every router's) plus our newest
    ``sent - received`` requests (sent, not there yet); without: ours."""
    if report is None:
        return ReplicaLoad(queued_prefill_tokens=sum(inflight.values()), running_requests=len(inflight))
    k = min(max(sent - received, 0), len(inflight))
    unseen = sum(islice(reversed(inflight.values()), k))
    return ReplicaLoad(queued_prefill_tokens=report.queued_prefill_tokens + unseen,
                       running_requests=report.num_running + report.num_waiting + k)


class Replica:
    """Owns: its name, how to connect, the live client (None while down),
    the engine's epoch, its liveness (``live``: connected, checked and
    followed by the router; the one record of it), the requests this fleet
    has in flight there (``inflight``: request id -> prompt tokens it has
    still to prefill, in dispatch order; 0 once it streams), the engine's
    last load report (``engine_load``: every router's requests, and how
    many of ours it had ``received``), and its connection history
    (``num_starts``, ``num_attempts``, ``last_error``).

    Every field is written by the methods below only; the ones that change
    liveness return whether it changed, and the fleet applies that to the
    router. Read the fields, never assign them."""

    __slots__ = ("name", "kind", "address", "connect", "client", "epoch", "live", "last_error", "num_starts",
                 "num_attempts", "inflight", "engine_load", "received", "load_at")

    def __init__(self, name: str, kind: str, connect: Connector, address: str | None = None) -> None:
        if kind not in ("local", "remote"):
            raise ValueError(f"replica kind must be 'local' or 'remote', got {kind!r}")
        self.name = name
        self.kind = kind
        self.address = address
        self.connect = connect
        self.client: MPEngineClient | None = None
        self.epoch = 0
        self.live = False
        self.inflight: dict[str, int] = {}
        self.engine_load: EngineLoad | None = None
        self.received = 0
        self.load_at = 0.0  # time.monotonic() of the engine's last report
        self.last_error: str | None = None
        self.num_starts = 0  # connections made (a local replica: engines started)
        self.num_attempts = 0  # connection attempts finished, failed or not

    # -- reading ------------------------------------------------------------------

    @property
    def up(self) -> bool:
        """Serving: the router may send it requests."""
        return self.live

    @property
    def running(self) -> int:
        """This fleet's requests in flight here."""
        return len(self.inflight)

    @property
    def queued_prefill(self) -> int:
        """Prompt tokens of this fleet's requests here that have not streamed yet."""
        return sum(self.inflight.values())

    def connection_lost(self) -> str | None:
        """Why a live replica's connection is gone (the client saw the engine
        die), or None while it holds."""
        client = self.client
        if not self.live:
            return None
        if client is None:
            return "engine connection lost"
        return "engine connection lost" if client.is_dead else None

    def load(self) -> ReplicaLoad:
        """The router's view of this replica's work (``load_of``): the
        engine's last report plus our requests it had not taken in yet;
        before any report, or when the last one is older than
        ``LOAD_REPORT_STALE_S`` (engines report at least every second), the
        requests this fleet has in flight here."""
        report, client = self.engine_load, self.client
        if report is None or client is None or time.monotonic() - self.load_at > P.LOAD_REPORT_STALE_S:
            return load_of(self.inflight, None, 0, 0)
        return load_of(self.inflight, report, self.received, client.num_requests_sent)

    # -- the connection -----------------------------------------------------------

    async def open(self) -> MPEngineClient:
        """Connect (or start) once; raises what the connection raised (the
        attempt is counted and its error kept either way). Not live yet:
        the fleet checks the engine and calls :meth:`mark_live`."""
        if self.client is not None:
            raise RuntimeError(f"replica {self.name} is already connected")
        try:
            client = await self.connect()
        except BaseException as e:
            self.num_attempts += 1
            self.last_error = f"{type(e).__name__}: {e}"
            raise
        self.num_attempts += 1
        self.num_starts += 1
        self.engine_load, self.received = None, 0  # a new connection: the engine counts our requests from 0
        self.client = client
        assert client.info is not None
        self.epoch = client.info.epoch
        self.address = client.address
        self.last_error = None
        return client

    def drop(self, reason: str) -> MPEngineClient | None:
        """A connection that will not serve (the engine does not fit the
        fleet, or failed while being attached): detached (the caller closes
        the client it returns), the reason kept. Only before it is live."""
        assert not self.live
        self.last_error = reason
        client, self.client = self.client, None
        return client

    def detach(self) -> MPEngineClient | None:
        """Before a reconnect: the old client (the caller closes it); only a
        replica that is down has one to give up."""
        assert not self.live
        client, self.client = self.client, None
        return client

    def mark_live(self) -> bool:
        """Checked and followed: it serves. True when that is a change."""
        if self.live or self.client is None:
            return False
        self.live = True
        return True

    def mark_down(self, reason: str, client: MPEngineClient | None = None) -> bool:
        """It stopped serving (its engine died, or it left); with ``client``,
        only if that is still its connection (a late failure of an older
        one says nothing of a new one). True when that is a change (then
        ``reason`` is its ``last_error``)."""
        if not self.live or (client is not None and client is not self.client):
            return False
        self.live = False
        self.last_error = reason
        return True

    async def close(self) -> None:
        """Down and disconnected (a local replica's engine is stopped)."""
        self.live = False
        client, self.client = self.client, None
        if client is not None:
            await client.aclose()

    # -- this fleet's requests ----------------------------------------------------

    def dispatched(self, request_id: str, uncached_tokens: int) -> None:
        """Request ``request_id`` is sent here with that many prompt tokens to prefill."""
        self.inflight[request_id] = max(uncached_tokens, 0)

    def prefill_started(self, request_id: str) -> bool:
        """Its first output arrived: its prompt is no longer queued here.
        True when that changed the load."""
        if self.inflight.get(request_id):
            self.inflight[request_id] = 0
            return True
        return False

    def settled(self, request_id: str) -> None:
        """The request ended here (finished, failed, aborted)."""
        self.inflight.pop(request_id, None)

    def note_load(self, load: EngineLoad, received: int) -> None:
        """The engine's report: its queued work and how many of our requests it had."""
        self.engine_load, self.received, self.load_at = load, received, time.monotonic()
