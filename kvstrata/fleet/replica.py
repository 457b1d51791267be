"""One engine replica as the fleet sees it: how to (re)connect to it, and its
live connection.

    local   an engine subprocess this process started (``serve --engines N``):
            when it dies, the fleet starts a new one (a new epoch)
    remote  an engine at an address (``kvstrata engine --listen tcp://...``, or
            one found in the registry): when it is unreachable, the fleet
            tries to connect again every ``retry_interval_s``
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
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


class Replica:
    """Owns: its name, how to connect, the live client (None while down),
    the engine's epoch, the requests this fleet has in flight there (their
    queued prefill tokens and count; ``inflight``: request id -> uncached
    prompt tokens, in dispatch order) and the engine's last load report
    (``engine_load``, which counts every router's requests, and how many
    of ours it had ``received``)."""

    __slots__ = ("name", "kind", "address", "connect", "client", "epoch", "queued_prefill",
                 "last_error", "num_starts", "num_attempts", "restarting", "inflight", "engine_load", "received",
                 "load_at")

    def __init__(self, name: str, kind: str, connect: Connector, address: str | None = None) -> None:
        if kind not in ("local", "remote"):
            raise ValueError(f"replica kind must be 'local' or 'remote', got {kind!r}")
        self.name = name
        self.kind = kind
        self.address = address
        self.connect = connect
        self.client: MPEngineClient | None = None
        self.epoch = 0
        self.queued_prefill = 0
        self.inflight: dict[str, int] = {}
        self.engine_load: EngineLoad | None = None
        self.received = 0
        self.load_at = 0.0  # time.monotonic() of the engine's last report
        self.last_error: str | None = None
        self.num_starts = 0  # connections made (a local replica: engines started)
        self.num_attempts = 0  # connection attempts finished, failed or not
        self.restarting: asyncio.Task[None] | None = None

    @property
    def up(self) -> bool:
        return self.client is not None and not self.client.is_dead

    @property
    def running(self) -> int:
        """This fleet's requests in flight here."""
        return len(self.inflight)

    def note_load(self, load: EngineLoad, received: int) -> None:
        """The engine's report: its queued work and how many of our requests it had."""
        self.engine_load, self.received, self.load_at = load, received, time.monotonic()

    def load(self) -> ReplicaLoad:
        """The router's view of this replica's work: the engine's last report
        (every router's requests) plus our requests it had not taken in yet;
        before any report, or when the last one is older than
        ``LOAD_REPORT_STALE_S`` (engines report at least every second), the
        requests this fleet has in flight there."""
        el, client = self.engine_load, self.client
        if el is None or client is None or time.monotonic() - self.load_at > P.LOAD_REPORT_STALE_S:
            return ReplicaLoad(queued_prefill_tokens=max(self.queued_prefill, 0), running_requests=self.running)
        k = min(max(client.num_requests_sent - self.received, 0), len(self.inflight))
        unseen = sum(islice(reversed(self.inflight.values()), k))  # the newest k: sent, not yet there
        return ReplicaLoad(queued_prefill_tokens=el.queued_prefill_tokens + unseen,
                           running_requests=el.num_running + el.num_waiting + k)

    async def open(self) -> MPEngineClient:
        """Connect (or start) once; raises what the connection raised."""
        client = await self.connect()
        self.num_starts += 1
        self.engine_load, self.received = None, 0  # a new connection: the engine counts our requests from 0
        self.client = client
        assert client.info is not None
        self.epoch = client.info.epoch
        self.address = client.address
        self.last_error = None
        return client

    async def close(self) -> None:
        if self.restarting is not None:
            self.restarting.cancel()
            await asyncio.gather(self.restarting, return_exceptions=True)
            self.restarting = None
        client, self.client = self.client, None
        if client is not None:
            await client.aclose()
