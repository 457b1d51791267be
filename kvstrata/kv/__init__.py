"""kvstrata.kv: the paged, prefix-cached device KV cache manager, and
nothing else (layer 1: it imports only ``kvstrata.types`` and itself).

KVCacheManager -> coordinator (no-prefix-cache, unitary, hybrid) ->
single-type managers (full, sliding window, chunked local, mamba, cross,
sink) -> BlockPool (blocks, free queue, hash map, null block).

A model describes its KV per layer with the specs here (``FullAttentionSpec``,
``SlidingWindowSpec``, ...); ``kvstrata.enginecore.builder`` groups equal
specs into ``KVCacheGroupSpec``s, and the group count and caching pick the
coordinator, each group's spec its manager (``SPEC_MANAGERS``).

The KV events this package records (``take_events``) are plain Structs; it
holds no socket or thread. Publishing them over ZMQ is the process side's
job: ``kvstrata.ipc.kv_publisher``. The KV connector (external tiers) is its
own layer above this one: ``kvstrata.connector``.
"""

from kvstrata.kv.block import KVCacheBlock
from kvstrata.kv.block_pool import BlockPool
from kvstrata.kv.coordinator import (
    BlockHashesView,
    HybridCoordinator,
    KVCacheCoordinator,
    NoPrefixCacheCoordinator,
    UnitaryCoordinator,
)
from kvstrata.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)
from kvstrata.kv.free_queue import FreeBlockQueue
from kvstrata.kv.hashing import (
    HASH_ALGOS,
    BlockHasher,
    CacheIdentity,
    HashFunction,
    get_hash_fn,
    make_block_hasher,
    root_hash,
)
from kvstrata.kv.manager import KVCacheBlocks, KVCacheManager
from kvstrata.kv.managers import SPEC_MANAGERS, get_manager_class
from kvstrata.kv.metrics import BlockResidencySample, PrefixCacheStats
from kvstrata.kv.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from kvstrata.types import RequestId  # the engine's request id type (one definition)
from kvstrata.kv.types import (
    BlockHash,
    BlockId,
    KVCacheError,
    KVRequest,
    MultiModalFeature,
    UnknownHashAlgorithmError,
    UnknownRequestError,
)

__all__ = [
    "HASH_ALGOS",
    "SPEC_MANAGERS",
    "AllBlocksCleared",
    "AttentionSpec",
    "BlockHash",
    "BlockHasher",
    "BlockHashesView",
    "BlockId",
    "BlockPool",
    "BlockRemoved",
    "BlockResidencySample",
    "BlockStored",
    "CacheIdentity",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "FreeBlockQueue",
    "FullAttentionSpec",
    "HashFunction",
    "HybridCoordinator",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheCoordinator",
    "KVCacheError",
    "KVCacheEvent",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheSpec",
    "KVEventBatch",
    "KVRequest",
    "MambaSpec",
    "MultiModalFeature",
    "NoPrefixCacheCoordinator",
    "PrefixCacheStats",
    "RequestId",
    "SinkFullAttentionSpec",
    "SlidingWindowSpec",
    "UnitaryCoordinator",
    "UnknownHashAlgorithmError",
    "UnknownRequestError",
    "get_hash_fn",
    "get_manager_class",
    "make_block_hasher",
    "root_hash",
]
