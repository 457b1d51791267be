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
from collections.abc import Awaitable, Callable

import msgspec
import structlog

from kvstrata.config import EngineConfig
from kvstrata.ipc import protocol as P
from kvstrata.ipc.mp_client import MPEngineClient

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
    the engine's epoch, and the requests this fleet has in flight there
    (their queued prefill tokens and count, the router's load)."""

    __slots__ = ("name", "kind", "address", "connect", "client", "epoch", "queued_prefill", "running",
                 "last_error", "num_starts", "num_attempts", "restarting")

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
        self.running = 0
        self.last_error: str | None = None
        self.num_starts = 0  # connections made (a local replica: engines started)
        self.num_attempts = 0  # connection attempts finished, failed or not
        self.restarting: asyncio.Task[None] | None = None

    @property
    def up(self) -> bool:
        return self.client is not None and not self.client.is_dead

    async def open(self) -> MPEngineClient:
        """Connect (or start) once; raises what the connection raised."""
        client = await self.connect()
        self.num_starts += 1
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
