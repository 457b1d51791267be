"""Reading a ZMQ socket from an asyncio loop without a future per message.

The socket's FD is edge-triggered: it signals that ``ZMQ_EVENTS`` may have
changed, not that a message is waiting. So a drain reads until ``ZMQ_EVENTS``
has no POLLIN (reading it processes the socket's commands, as a recv does,
and is cheaper than a recv that raises EAGAIN), and
every send schedules one more drain (a send may process incoming commands and
consume the edge without the FD firing again). A drain reads at most
``budget`` messages before yielding to the loop, so one flooding peer cannot
starve the others.

The FD also fires when a peer's queue that was full (high-water mark)
drains: libzmq tells the socket with a command, which the drain's ``recv``
processes. So ``on_drained`` (called after every drain) is where a sender
retries what ``zmq.Again`` refused, with no timer and no polling.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq


class ZmqReader:
    """Calls ``on_message(frames)`` for every multipart message on ``sock``.
    Owns: the loop's reader registration for the socket's FD."""

    __slots__ = ("_loop", "_sock", "_on_message", "_on_drained", "_budget", "_copy", "_scheduled", "_active",
                 "_fd")

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: zmq.Socket,
                 on_message: Callable[[list[bytes]], None] | Callable[[list[zmq.Frame]], None],
                 budget: int = 4096, copy: bool = True,
                 on_drained: Callable[[], None] | None = None) -> None:
        self._loop = loop
        self._sock = sock
        self._on_message = on_message
        self._on_drained = on_drained
        self._budget = budget
        self._copy = copy  # False: zmq.Frame objects (for SRCFD)
        self._scheduled = False
        self._active = False
        self._fd = sock.getsockopt(zmq.FD)

    def start(self) -> None:
        self._active = True
        self._loop.add_reader(self._fd, self._drain)
        self.kick()

    def kick(self) -> None:
        """Schedule a drain soon (after a send, or when the budget ran out)."""
        if self._active and not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def stop(self) -> None:
        if self._active:
            self._active = False
            self._loop.remove_reader(self._fd)

    def drain_now(self) -> None:
        """Handle whatever is queued, synchronously (to order two sockets)."""
        self._drain()

    def _drain(self) -> None:
        self._scheduled = False
        if not self._active:
            return
        sock = self._sock
        recv = sock.recv_multipart
        handle = self._on_message
        copy = self._copy
        for _ in range(self._budget):
            try:
                # ZMQ_EVENTS processes the socket's pending commands, as a recv
                # does, without an exception when nothing is waiting
                if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    break
                frames = recv(zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                break
            except zmq.ZMQError:
                if not self._active:  # closed by the handler
                    return
                raise
            handle(frames)
            if not self._active:
                return
        else:
            self.kick()
        if self._on_drained is not None:
            self._on_drained()
