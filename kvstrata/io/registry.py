"""Tier types by name, plus loading a user's tier class by dotted path.

    TierSpec(type="disk", ...)                          built-in
    TierSpec(type="my_pkg.tiers.S3Tier", ...)           imported at build time
    TierSpec(type="my_pkg.tiers:S3Tier", ...)           same, explicit split

A tier class provides ``from_spec(spec, prefix)`` and the ``LowerTier``
protocol (see ``backends.base``).
"""

from __future__ import annotations

import importlib

from kvstrata.io.backends.base import LOWER_TIER_MEMBERS, LowerTier
from kvstrata.io.backends.disk import DiskTier
from kvstrata.io.backends.fs import FSTier
from kvstrata.io.backends.redis import RedisTier
from kvstrata.io.backends.redis_cluster import RedisClusterTier
from kvstrata.io.config import TierSpec


class TierRegistry:
    """Owns: the map from tier type name to class (one per store; no
    module-level registry)."""

    __slots__ = ("_types",)

    def __init__(self, *, builtins: bool = True) -> None:
        self._types: dict[str, type] = {}
        if builtins:
            self.register("disk", DiskTier)
            self.register("fs", FSTier)
            self.register("redis", RedisTier)
            self.register("redis-cluster", RedisClusterTier)

    def names(self) -> list[str]:
        return sorted(self._types)

    def register(self, name: str, cls: type) -> None:
        if not name or "." in name or ":" in name:
            raise ValueError(f"tier type name must be non-empty without '.' or ':', got {name!r}")
        if not callable(getattr(cls, "from_spec", None)):
            raise TypeError(f"tier class {cls!r} has no from_spec(spec, prefix) classmethod")
        self._types[name] = cls

    def resolve(self, type_name: str, prefix: str = "tier") -> type:
        cls = self._types.get(type_name)
        if cls is not None:
            return cls
        if "." not in type_name and ":" not in type_name:
            raise ValueError(f"{prefix}.type {type_name!r} is not one of {self.names()} nor a dotted class path")
        module, _, attr = type_name.partition(":") if ":" in type_name else type_name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{prefix}.type: cannot load {type_name!r}: {e}") from None
        if not isinstance(cls, type) or not callable(getattr(cls, "from_spec", None)):
            raise TypeError(f"{prefix}.type: {type_name!r} is not a class with from_spec(spec, prefix)")
        return cls

    def build(self, spec: TierSpec, prefix: str = "tier") -> LowerTier:
        tier = self.resolve(spec.type, prefix).from_spec(spec, prefix)
        missing = [m for m in LOWER_TIER_MEMBERS if not hasattr(tier, m)]
        if missing:
            raise TypeError(f"{prefix}.type: {spec.type!r} does not implement LowerTier; missing {missing}")
        return tier
