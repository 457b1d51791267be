"""Errors the engine raises to its callers.

``RequestError`` (a ValueError) is bad input for one request: it names the
field and nothing was queued; the engine keeps serving everyone else.
``EngineOverloadedError`` means the bounded waiting queue is full: retry later.
``EngineDeadError`` means the engine stopped (closed, or its loop or model
failed): every pending and future call gets it, so callers fail fast instead
of hanging.
"""

from __future__ import annotations


class RequestError(ValueError):
    """A request was rejected before it was queued; ``field`` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message if message.startswith(field) else f"{field}: {message}")
        self.field = field


class EngineOverloadedError(RuntimeError):
    """The waiting queue is at its limit (``scheduler.max_waiting_requests``)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"engine overloaded: {limit} requests already waiting "
            f"(scheduler.max_waiting_requests={limit}); retry later"
        )
        self.limit = limit


class EngineDeadError(RuntimeError):
    """The engine is not running any more; ``cause`` says why when known."""

    def __init__(self, message: str = "engine is dead", cause: BaseException | None = None) -> None:
        super().__init__(message if cause is None else f"{message}: {cause!r}")
        self.cause = cause
