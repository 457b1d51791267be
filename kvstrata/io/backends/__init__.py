"""Tiers of the store: L1 CPU memory, and the lower tiers (local disk, a
shared filesystem, Redis) behind the ``LowerTier`` protocol."""

from kvstrata.io.backends.base import Health, LowerTier, ObjectMeta
from kvstrata.io.backends.cpu import CPUTier
from kvstrata.io.backends.disk import DiskTier
from kvstrata.io.backends.fs import FSTier
from kvstrata.io.backends.redis import RedisTier

__all__ = ["CPUTier", "DiskTier", "FSTier", "Health", "LowerTier", "ObjectMeta", "RedisTier"]
