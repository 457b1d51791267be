"""kvstrata.io: the tiered KV store (L1 CPU memory, L2 local disk, L3 Redis
or a shared filesystem) behind priority executors.

The one entry point: ``StorageManager``; every read, lookup and pin goes
through it (see its module docstring for the put / lookup / get flow). Keys come from ``ChunkKeyer`` over the device block-hash
chain; bytes live in ``MemoryObj``s carved from L1 by an allocator.
"""

from kvstrata.io.allocators import Allocator, FirstFitAllocator, SlotAllocator
from kvstrata.io.backends import CPUTier, DiskTier, FSTier, LowerTier, ObjectMeta, RedisTier
from kvstrata.io.config import (
    CPUConfig,
    DiskOptions,
    FSOptions,
    HealthConfig,
    RedisOptions,
    StoreConfig,
    TierSpec,
)
from kvstrata.io.executors import Priority, PriorityExecutor
from kvstrata.io.keys import ALL_LAYERS, ChunkKey, ChunkKeyer, ChunkSpan, StoreIdentity
from kvstrata.io.memory import MemoryObj
from kvstrata.io.policies import POLICIES, CachePolicy, make_policy
from kvstrata.io.registry import TierRegistry
from kvstrata.io.sources import L1_SOURCE, Pin
from kvstrata.io.stats import Outstanding, StoreStats, TierStats
from kvstrata.io.storage_manager import StorageManager

__all__ = [
    "ALL_LAYERS", "Allocator", "CPUConfig", "CPUTier", "CachePolicy", "ChunkKey", "ChunkKeyer",
    "ChunkSpan", "DiskOptions", "DiskTier", "FSOptions", "FSTier", "FirstFitAllocator",
    "HealthConfig", "L1_SOURCE", "LowerTier", "MemoryObj", "ObjectMeta", "Outstanding", "POLICIES",
    "Pin", "Priority", "PriorityExecutor", "RedisOptions", "RedisTier", "SlotAllocator",
    "StorageManager", "StoreConfig", "StoreIdentity", "StoreStats", "TierRegistry", "TierSpec",
    "TierStats", "make_policy",
]
