"""Per-attention-type managers and the spec -> manager registry."""

from __future__ import annotations

from types import MappingProxyType

from kvstrata.kv.managers.base import SingleTypeKVCacheManager
from kvstrata.kv.managers.cross import CrossAttentionManager
from kvstrata.kv.managers.full import FullAttentionManager, SinkFullAttentionManager
from kvstrata.kv.managers.mamba import MambaManager
from kvstrata.kv.managers.windowed import ChunkedLocalAttentionManager, SlidingWindowManager
from kvstrata.kv.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)

#: Exact spec type -> manager class. Read-only; a new attention type adds a
#: spec, a manager and one line here.
SPEC_MANAGERS = MappingProxyType(
    {
        FullAttentionSpec: FullAttentionManager,
        SlidingWindowSpec: SlidingWindowManager,
        ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
        MambaSpec: MambaManager,
        CrossAttentionSpec: CrossAttentionManager,
        SinkFullAttentionSpec: SinkFullAttentionManager,
    }
)


def get_manager_class(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager class for ``spec`` (by exact type, then by base class)."""
    cls = SPEC_MANAGERS.get(type(spec))
    if cls is None:
        for base in type(spec).__mro__[1:]:
            cls = SPEC_MANAGERS.get(base)  # type: ignore[call-overload]
            if cls is not None:
                break
    if cls is None:
        raise TypeError(f"no KV cache manager is registered for spec type {type(spec).__name__}")
    return cls


__all__ = [
    "SPEC_MANAGERS",
    "ChunkedLocalAttentionManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "MambaManager",
    "SingleTypeKVCacheManager",
    "SinkFullAttentionManager",
    "SlidingWindowManager",
    "get_manager_class",
]
