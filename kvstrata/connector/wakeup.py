"""The engine's wake-up, as a connector holds it.

    connector.set_wakeup(cb)     the engine, once (cb: thread-safe, e.g. through
                                 loop.call_soon_threadsafe)
    wakeup()                     the connector, whenever a lookup, a load or a
                                 store write completes; usable as a done callback

A connector builds its parts before the engine hands it the callback, so the
parts share one ``Wakeup`` and the engine sets what it calls.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)


class Wakeup:
    """Owns: the engine's wake-up callback (none until ``set``)."""

    __slots__ = ("_callback",)

    def __init__(self) -> None:
        self._callback: Callable[[], None] | None = None

    def set(self, callback: Callable[[], None] | None) -> None:
        self._callback = callback

    def __call__(self, *_done: object) -> None:
        """Wake the engine (the arguments of a done callback are ignored).
        A callback that raises is logged: it runs inside the store's and the
        tasks' bookkeeping, which must go on."""
        callback = self._callback
        if callback is None:
            return
        try:
            callback()
        except Exception:
            log.exception("kv_connector_wakeup_failed")
