"""Starting the engine subprocess and watching it die.

The child is ``python -m kvstrata.ipc.engine_proc`` (a fresh interpreter:
no forked torch threads, no inherited event loop). Its config travels on
its stdin, never in argv: argv is readable by every local user (``ps``,
``/proc/PID/cmdline``), and the config can hold secrets (a Redis password). Its exit is observed with a
pidfd on the event loop, so a ``kill -9`` is seen within milliseconds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence

import msgspec
import structlog

from kvstrata.config import EngineConfig
from kvstrata.ipc import protocol as P

log = structlog.get_logger(__name__)


class ProcessWatch:
    """Calls ``on_exit(returncode)`` once when a process ends.
    Owns: the pidfd and its reader registration."""

    __slots__ = ("_loop", "_proc", "_pidfd", "_on_exit", "exited")

    def __init__(self, loop: asyncio.AbstractEventLoop, proc: subprocess.Popen | int,
                 on_exit: Callable[[int | None], None]) -> None:
        self._loop = loop
        self._proc = proc
        self._on_exit = on_exit
        self.exited = asyncio.Event()
        pid = proc.pid if isinstance(proc, subprocess.Popen) else proc
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self._pidfd = None
            loop.call_soon(self._fire)
            return
        loop.add_reader(self._pidfd, self._fire)

    def _fire(self) -> None:
        self.close()
        code = self._proc.poll() if isinstance(self._proc, subprocess.Popen) else None
        self.exited.set()
        self._on_exit(code)

    def close(self) -> None:
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None


def spawn_engine(config: EngineConfig, address: str, credentials: P.Credentials, *, watch_parent: bool = True,
                 log_json: bool | None = None, max_frame_bytes: int | None = None,
                 wrapper: Sequence[str] = ()) -> subprocess.Popen:
    """Start the engine process bound to ``address``; it exits when this
    process dies (``--parent-pid``), so an engine is never orphaned. The
    config and the engine's credentials are written to its stdin (a pipe
    only it reads): no secret is ever in its argv.

    ``wrapper``: a command the engine's command line is appended to (a
    profiler such as ``["py-spy", "record", "-o", "engine.txt", "--"]``,
    ``numactl``, or a script that prepares the process and runs
    ``kvstrata.ipc.engine_proc.main`` itself). It must pass stdin on and
    end when the engine does; the signals go to it."""
    if address.startswith("tcp://") and not credentials.curve:
        raise ValueError("an engine on tcp:// needs CURVE credentials (Credentials.new(curve=True))")
    cmd = [*wrapper, sys.executable, "-m", "kvstrata.ipc.engine_proc", "--address", address, "--config-stdin"]
    if watch_parent:
        cmd += ["--parent-pid", str(os.getpid())]
    if max_frame_bytes is not None:
        cmd += ["--max-frame-bytes", str(max_frame_bytes)]
    if log_json is not None:
        cmd += ["--log-json" if log_json else "--log-console"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, start_new_session=True)
    assert proc.stdin is not None
    try:  # a config is a few KiB: well within a pipe's buffer, so this does not block
        proc.stdin.write(msgspec.json.encode(P.Launch(config=config, credentials=credentials.for_engine())))
        proc.stdin.close()
    except BrokenPipeError:
        pass  # the child already died; its exit is reported by the watch
    log.info("engine_process_started", pid=proc.pid, address=address)
    return proc


async def stop_process(proc: subprocess.Popen, exited: asyncio.Event, grace_s: float) -> int | None:
    """Wait ``grace_s`` for a clean exit, then SIGTERM, then SIGKILL."""
    for sig, wait in ((None, grace_s), (signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            break
        if sig is not None:
            proc.send_signal(sig)
            log.warning("engine_process_signalled", pid=proc.pid, signal=sig.name)
        try:
            async with asyncio.timeout(wait):
                await exited.wait()
        except TimeoutError:
            continue
    return proc.poll()
