"""The registry (``fleet.registry``) wired to engines and to the fleet.

    register_engine(url, address, engine_id, config)   what `kvstrata engine --registry` announces
    follow_registry(url, replicas, router_config, credentials)
                                                       a FleetClient over the registered engines,
                                                       adding and removing them as they come and go
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import structlog

from kvstrata.config import EngineConfig
from kvstrata.enginecore.client import served_model_name
from kvstrata.errors import EngineDeadError
from kvstrata.fleet.client import FleetClient
from kvstrata.fleet.registry import (EngineDirectory, EngineRecord, EngineRegistration, RegistryConfig,
                                     RegistryUnavailable)
from kvstrata.fleet.replica import Replica, remote_connector
from kvstrata.ipc import protocol as P
from kvstrata.router import RouterConfig

log = structlog.get_logger(__name__)


class EngineAnnouncer:
    """``kvstrata.ipc.engine_proc.Registration`` over the registry: once the
    engine serves, its record (address, epoch, pid) is written and kept
    alive; at stop it is deleted. Owns: the registration, once started."""

    def __init__(self, config: RegistryConfig, engine_id: str, address: str, model: str) -> None:
        self.config = config
        self.engine_id = engine_id
        self.address = address
        self.model = model
        self._reg: EngineRegistration | None = None
        self._retry: asyncio.Task[None] | None = None

    async def start(self, epoch: int, pid: int) -> None:
        """Register now, or (the registry is unreachable: the engine serves
        anyway) keep trying every heartbeat in the background."""
        record = EngineRecord.here(self.engine_id, self.address, epoch, self.model)
        self._reg = EngineRegistration(self.config, record)
        if not await self._try():
            self._retry = asyncio.get_running_loop().create_task(self._keep_trying())

    async def _try(self) -> bool:
        assert self._reg is not None
        try:
            await self._reg.start()
        except RegistryUnavailable as e:
            log.error("engine_registration_failed", url=self.config.url, error=str(e),
                      retry_in_s=self.config.heartbeat_s)
            return False
        return True

    async def _keep_trying(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            if await self._try():
                return

    async def aclose(self) -> None:
        retry, self._retry = self._retry, None
        if retry is not None:
            retry.cancel()
            await asyncio.gather(retry, return_exceptions=True)
        reg, self._reg = self._reg, None
        if reg is not None:
            await reg.aclose()


def register_engine(url: str, address: str, engine_id: str | None, config: EngineConfig) -> EngineAnnouncer:
    """The announcer `kvstrata engine --registry URL` starts once serving.
    ``engine_id`` defaults to the address's HOST:PORT."""
    if address.startswith("tcp://") and address.rpartition(":")[0].endswith(("0.0.0.0", "*", "[::]")):
        raise ValueError(f"--advertise: routers cannot connect to {address}; give the address they should use")
    registry = RegistryConfig(url=url)
    return EngineAnnouncer(registry, engine_id or address.split("://", 1)[1], address, served_model_name(config))


async def follow_registry(url: str, replicas: Sequence[Replica], router_config: RouterConfig,
                          credentials: P.Credentials | None, *, interval_s: float | None = None) -> FleetClient:
    """A fleet of ``replicas`` plus every engine registered at ``url``, then
    following the registry (its announcements at once, a full re-read every
    ``interval_s``: by default the registry's ``scan_interval_s``). With no
    other replica, an unreachable registry or an empty one is an error
    naming it."""
    registry = RegistryConfig(url=url)
    directory = EngineDirectory(registry)
    try:
        members = await directory.members()
    except RegistryUnavailable as e:
        if not replicas:
            await directory.aclose()
            raise EngineDeadError(f"engine registry unreachable: {e}") from None
        log.error("fleet_registry_unreachable_at_start", url=url, error=str(e))
        members = {}
    everyone = list(replicas) + [_replica(r, credentials) for r in members.values()]
    if not everyone:
        await directory.aclose()
        raise EngineDeadError(f"no engine is registered at {url} (fleet {registry.fleet!r})")
    try:
        fleet = await FleetClient.start(everyone, router_config)
    except BaseException:
        await directory.aclose()
        raise
    fleet.follow(directory, lambda rec: _replica(rec, credentials), interval_s=interval_s)
    return fleet


def _replica(record: EngineRecord, credentials: P.Credentials | None) -> Replica:
    return Replica(record.engine_id, "remote", remote_connector(record.address, credentials),
                   address=record.address)
