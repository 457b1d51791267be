"""Pick the engine transport by configuration alone: every choice returns an
object with the AsyncEngine API (generate, abort, stats, reset_prefix_cache,
aclose)."""

from __future__ import annotations

from typing import Any

from kvstrata.config import EngineConfig

TRANSPORTS = ("inproc", "ipc", "tcp")


async def open_engine(config: EngineConfig, transport: str = "ipc", *, address: str | None = None) -> Any:
    """``inproc``: AsyncEngine in this process. ``ipc``/``tcp``: spawn the engine
    subprocess (bound to ``address`` if given) and return a multiprocess
    client. ``connect_engine`` joins an engine that is already running."""
    if transport == "inproc":
        if address is not None:
            raise ValueError("address: not used with transport 'inproc'")
        from kvstrata.enginecore.async_engine import AsyncEngine

        return await AsyncEngine.start(config)
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    from kvstrata.ipc.mp_client import MPEngineClient

    return await MPEngineClient.start(config, transport=transport, address=address)


async def connect_engine(address: str) -> Any:
    from kvstrata.ipc.mp_client import MPEngineClient

    return await MPEngineClient.connect(address)
