"""Pick the engine transport by configuration alone: every choice returns an
``EngineClient`` (``kvstrata.enginecore.client``), in process or over ZMQ.
Also where an in-process engine gets its KV events publisher (a ZMQ socket
of this layer, handed down to the engine as a sink)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstrata.config import EngineConfig
from kvstrata.enginecore.client import EngineClient

if TYPE_CHECKING:
    from kvstrata.enginecore.async_engine import AsyncEngine
    from kvstrata.ipc.kv_publisher import ZmqEventPublisher

TRANSPORTS = ("inproc", "ipc", "tcp")


async def open_engine(config: EngineConfig, transport: str = "ipc", *, address: str | None = None) -> EngineClient:
    """``inproc``: AsyncEngine in this process. ``ipc``/``tcp``: spawn the engine
    subprocess (bound to ``address`` if given) and return a multiprocess
    client. ``connect_engine`` joins an engine that is already running."""
    if transport == "inproc":
        if address is not None:
            raise ValueError("address: not used with transport 'inproc'")
        return await start_async_engine(config)
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    from kvstrata.ipc.mp_client import MPEngineClient

    return await MPEngineClient.start(config, transport=transport, address=address)


async def connect_engine(address: str) -> EngineClient:
    """Join a running engine over ipc:// (its 0700 directory is the access
    control). Over tcp:// an engine answers only clients holding its owner's
    CURVE keys: use ``MPEngineClient.connect(address, credentials=...)``."""
    from kvstrata.ipc.mp_client import MPEngineClient

    return await MPEngineClient.connect(address)


async def start_async_engine(config: EngineConfig) -> AsyncEngine:
    """An AsyncEngine on this loop, publishing its KV events when
    ``cache.kv_events_endpoint`` is set (the engine closes the publisher)."""
    from kvstrata.enginecore.async_engine import AsyncEngine

    events = await open_kv_events(config)
    try:
        return await AsyncEngine.start(config, kv_events=events)
    except BaseException:
        if events is not None:
            await events.aclose()
        raise


async def open_kv_events(config: EngineConfig) -> ZmqEventPublisher | None:
    """The started KV events publisher ``cache.kv_events_endpoint`` names, or None."""
    endpoint = config.cache.kv_events_endpoint
    if endpoint is None:
        return None
    from kvstrata.ipc.kv_publisher import ZmqEventPublisher

    c = config.cache
    return await ZmqEventPublisher(endpoint, replay_endpoint=c.kv_events_replay_endpoint,
                                   buffer_steps=c.kv_events_buffer_steps, wire_format=c.kv_events_format,
                                   int_hashes=c.kv_events_int_hashes).start()
