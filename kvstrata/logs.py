"""structlog set-up, called once by each process entry point (never at import)."""

from __future__ import annotations

import logging
import sys

import structlog


class _Stderr:
    """``sys.stderr`` as it is at each write: a logger configured while
    stderr was temporarily replaced (a test's capture, a notebook cell) keeps
    writing to the real one afterwards instead of a closed stream."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "INFO", json: bool | None = None) -> None:
    """Console rendering in a terminal, JSON lines otherwise (or as forced)."""
    if json is None:
        json = not sys.stderr.isatty()
    renderer = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelName(level.upper())
        ),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),
        cache_logger_on_first_use=True,
    )
