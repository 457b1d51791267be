"""Fixtures of the serve tests (builders live in serve_helpers)."""

from serve_helpers import engine_url  # noqa: F401  (a module-scoped fixture)
