"""The engine subprocess: ``python -m kvstrata.ipc.engine_proc --address URL
--config-stdin`` (the EngineConfig as JSON on stdin, so no secret is ever in
argv).

Lifecycle (a small state machine; every path ends in ``EngineDead`` to the
clients, so none of them hangs):

    starting ──(engine ready)──▶ serving ──(Shutdown | SIGTERM | parent died
                                           | engine died)──▶ stopped

Exit code 0 on a requested shutdown, 1 when the engine failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from typing import Protocol

import msgspec
import structlog

from kvstrata.config import EngineConfig
from kvstrata.logs import configure_logging
from kvstrata.ipc import protocol as P
from kvstrata.ipc.addresses import check_address
from kvstrata.ipc.engine_server import EngineServer
from kvstrata.ipc.launcher import ProcessWatch

log = structlog.get_logger(__name__)


class Registration(Protocol):
    """Announces a serving engine (``kvstrata.fleet.discovery``: a key in
    Redis with a TTL); started once the engine serves, closed when it stops."""

    async def start(self, epoch: int, pid: int) -> None: ...

    async def aclose(self) -> None: ...


async def serve_engine(config: EngineConfig, address: str, credentials: P.Credentials, *,
                       parent_pid: int | None = None, max_frame_bytes: int = P.DEFAULT_MAX_FRAME_BYTES,
                       registration: Registration | None = None) -> int:
    """Bind, start the engine, serve until told to stop. Returns the exit code."""
    loop = asyncio.get_running_loop()
    server = EngineServer(address, msgspec.to_builtins(config), credentials, max_frame_bytes=max_frame_bytes)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.stop, f"signal {sig.name}")
    watch = ProcessWatch(loop, parent_pid, lambda _: server.stop("parent process exited")) if parent_pid else None
    engine = None
    failed = False
    try:
        # the engine is heavy (torch): after the bind
        from kvstrata.enginecore.async_engine import AsyncEngine
        from kvstrata.ipc.engines import open_kv_events
        from kvstrata.ipc.kv_feed import KVEventFeed

        events = await open_kv_events(config)  # the vLLM-compatible publisher, when configured
        c = config.cache
        feed = (KVEventFeed(epoch=server.epoch, tee=events, buffer_steps=c.kv_events_buffer_steps,
                            wire_format=c.kv_events_format, int_hashes=c.kv_events_int_hashes)
                if c.enable_kv_events else None)
        try:
            engine = await AsyncEngine.start(config, kv_events=feed or events)
        except BaseException:
            if feed is not None or events is not None:
                await (feed or events).aclose()
            raise
        server.attach(engine, kv_feed=feed)
        log.info("engine_ready", address=address, pid=os.getpid(), epoch=server.epoch)
        if registration is not None:
            await registration.start(server.epoch, os.getpid())
        await server.stopped.wait()
        failed = server.stop_reason.startswith("engine died")
    except Exception as e:
        failed = True
        server.stop_reason = f"engine failed: {type(e).__name__}: {e}"
        log.exception("engine_failed")
    finally:
        if registration is not None:
            with contextlib.suppress(Exception):  # leaving the registry is best effort: its TTL expires
                await registration.aclose()
        await server.close(server.stop_reason or "stopped")
        if engine is not None:
            await engine.aclose()
        if watch is not None:
            watch.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    log.info("engine_stopped", reason=server.stop_reason)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstrata.ipc.engine_proc")
    p.add_argument("--address", required=True)
    p.add_argument("--config-stdin", action="store_true", required=True,
                   help="read the EngineConfig and the engine's credentials as JSON from stdin "
                        "(never from argv: they hold secrets)")
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--max-frame-bytes", type=int, default=P.DEFAULT_MAX_FRAME_BYTES)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--log-json", dest="log_json", action="store_const", const=True, default=None)
    g.add_argument("--log-console", dest="log_json", action="store_const", const=False)
    args = p.parse_args(argv)
    launch = msgspec.json.decode(sys.stdin.buffer.read(), type=P.Launch)
    config = launch.config
    configure_logging(config.log_level, json=args.log_json)
    config.validate()
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    return runner(serve_engine(config, check_address(args.address), launch.credentials, parent_pid=args.parent_pid,
                               max_frame_bytes=args.max_frame_bytes))


if __name__ == "__main__":
    sys.exit(main())
