"""What every lower tier (disk, shared filesystem, Redis, user tiers)
provides to the StorageManager, and the health state they share.

A lower tier never raises into the manager for a fault of its medium: an
unreachable server, a full or read-only disk, a missing or corrupt object all
become a miss (``submit_read`` resolves False / ``metas`` says None) or a
dropped put (``submit_put`` returns False), counted in the tier's counters.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import msgspec
import structlog

from kvstrata.io.config import HealthConfig, TierSpec
from kvstrata.io.keys import ChunkKey
from kvstrata.io.memory import MemoryObj
from kvstrata.io.stats import TierCounters, TierStats

log = structlog.get_logger(__name__)


class ObjectMeta(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Enough about a stored object to allocate room for it in L1."""

    shape: tuple[int, ...]
    dtype: str
    layout: str
    nbytes: int


@runtime_checkable
class LowerTier(Protocol):
    """A tier below L1. Built by ``from_spec``; ``start`` before use."""

    name: str
    kind: str
    write_back: bool
    counters: TierCounters

    @classmethod
    def from_spec(cls, spec: TierSpec, prefix: str) -> LowerTier: ...

    async def start(self) -> None: ...

    @property
    def available(self) -> bool: ...

    @property
    def pending(self) -> int: ...

    def has(self, key: ChunkKey) -> bool | None:
        """True/False when known without I/O (a local index), else None."""
        ...

    async def metas(self, keys: Sequence[ChunkKey]) -> list[ObjectMeta | None]: ...

    def submit_put(self, key: ChunkKey, obj: MemoryObj) -> asyncio.Future[bool] | None:
        """Queue a write of ``obj`` (the job holds its own reference); the
        future says whether it was written. None: not queued (already stored
        or being stored, unavailable, full, saturated: counted as dropped
        unless already stored)."""
        ...

    def submit_read(self, key: ChunkKey, meta: ObjectMeta, dst: MemoryObj) -> asyncio.Future[bool] | None:
        """Queue a read into ``dst`` at prefetch priority; the future says
        whether ``dst`` now holds the verified object. None: not queued."""
        ...

    def submit_remove(self, key: ChunkKey) -> bool: ...

    def pin(self, key: ChunkKey) -> bool:
        """Keep ``key`` from eviction; False if this tier cannot pin it."""
        ...

    def unpin(self, key: ChunkKey) -> None: ...

    def stats(self) -> TierStats: ...

    def pinned_count(self) -> int: ...

    async def drain(self) -> None: ...

    async def aclose(self) -> None: ...


LOWER_TIER_MEMBERS = (
    "name", "kind", "write_back", "counters", "from_spec", "start", "available", "pending",
    "has", "metas", "submit_put", "submit_read", "submit_remove", "pin", "unpin", "stats",
    "pinned_count", "drain", "aclose",
)


class Health:
    """Owns: one tier's availability (a circuit breaker)::

        available ──fault──> unavailable ──retry time passed──> ops let through
            ^                                                        │
            └───────────────────── an op succeeds ───────────────────┘

    While unavailable, ``allow()`` is False and the tier answers misses and
    drops puts without touching its medium; each failed retry doubles the
    wait up to the configured maximum.
    """

    __slots__ = ("tier", "available", "last_error", "_retry_at", "_interval", "_cfg")

    def __init__(self, tier: str, cfg: HealthConfig) -> None:
        self.tier = tier
        self.available = True
        self.last_error: str | None = None
        self._cfg = cfg
        self._interval = cfg.retry_interval_s
        self._retry_at = 0.0

    def allow(self) -> bool:
        return self.available or time.monotonic() >= self._retry_at

    def ok(self) -> None:
        if not self.available:
            self.available = True
            self._interval = self._cfg.retry_interval_s
            log.info("tier_recovered", tier=self.tier)

    def fault(self, err: BaseException | str) -> None:
        self.last_error = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
        self._retry_at = time.monotonic() + self._interval
        if self.available:
            self.available = False
            log.warning("tier_unavailable", tier=self.tier, error=self.last_error,
                        retry_in_s=self._interval)
        self._interval = min(self._interval * 2, self._cfg.max_retry_interval_s)
